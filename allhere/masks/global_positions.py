"""Global tokens (Longformer, "Longformer: The Long-Document Transformer", arXiv:2004.05150): the flags
that say which positions are global, the predicate of global tokens, and Longformer's pattern (a window OR
global tokens).

Global tokens are given by position: the first ``g`` tokens (``global_first``), a list of positions
(``global_at``), or the positions holding given token ids (``global_from_ids``: a separator, a question
mark). The last needs the input ids, which an attention mechanism never sees (the host hands it q, k, v and
the block input x); ``global_from_ids`` is therefore for code that has the ids (masks, plots, an encoder of
one's own), while the ``longformer`` mechanism takes first-g and positions only.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .mask import Mask
from .predicates import or_masks
from .tables import DeviceTables
from .windows import dilated_window

INLINE_RUNS = 8  # global positions in at most this many runs are compared with, not looked up


def global_first(n: int, g: int) -> torch.Tensor:
    """bool [n]: the first ``g`` positions are global."""
    return torch.arange(n) < g


def global_at(n: int, positions: Iterable[int]) -> torch.Tensor:
    """bool [n]: the given positions (those below n) are global."""
    out = torch.zeros(n, dtype=torch.bool)
    pos = [p for p in positions if 0 <= p < n]
    if pos:
        out[torch.tensor(pos)] = True
    return out


def global_from_ids(ids: torch.Tensor, token_ids: Iterable[int]) -> torch.Tensor:
    """bool like ``ids`` ([n] or [batch, n]): positions holding one of ``token_ids`` are global."""
    return torch.isin(ids, torch.tensor(list(token_ids), dtype=ids.dtype, device=ids.device))


def _lookup(flags: torch.Tensor):
    """pos -> flags[pos] (flags [n] or [batch, n]) for broadcastable positions; False outside [0, n); and
    whether a flag lies in [lo, hi]; and the tables' ``prepare``."""
    n = flags.shape[-1]
    counts = torch.cat([torch.zeros(*flags.shape[:-1], 1, dtype=torch.long), flags.long().cumsum(-1)], -1)
    tables = DeviceTables(flags=flags, counts=counts)

    def at(b, pos):
        f = tables.get("flags", pos)
        i = pos.clamp(0, max(n - 1, 0))
        hit = f[i] if f.dim() == 1 else f[torch.as_tensor(b, device=pos.device), i]
        return hit & (pos >= 0) & (pos < n)

    def any_in(b, lo, hi):  # some flagged position in [lo, hi]
        c = tables.get("counts", lo)
        lo_c, hi_c = lo.clamp(0, n), (hi + 1).clamp(0, n)
        if c.dim() == 1:
            got = c[hi_c] - c[lo_c]
        else:
            bb = torch.as_tensor(b, device=lo.device)
            got = c[bb, hi_c] - c[bb, lo_c]
        return (got > 0) & (hi >= lo)

    return at, any_in, tables.prepare


def _runs(flags: torch.Tensor) -> list[tuple[int, int]] | None:
    """The runs [first, last] of consecutive global positions of 1-D ``flags``, or None beyond
    ``INLINE_RUNS`` runs."""
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), flags.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    if len(edges) > 2 * INLINE_RUNS:
        return None
    return [(edges[i], edges[i + 1] - 1) for i in range(0, len(edges), 2)]


def _in_runs(runs: list[tuple[int, int]]):
    """pos -> whether pos lies in one of ``runs``: comparisons only, no table read."""
    def at(b, pos):
        if not runs:
            return (pos < 0) & (pos >= 0)  # False, shaped like pos
        out = None
        for lo, hi in runs:
            inside = (pos >= lo) & (pos <= hi)
            out = inside if out is None else out | inside
        return out

    return at


def global_tokens(is_global: torch.Tensor, causal: bool = True) -> Mask:
    """Global tokens (Longformer, arXiv:2004.05150): ``is_global`` bool [n] or [batch, n] over absolute
    positions (positions past its end are not global). A global query sees every key, every query sees
    every global key; with ``causal`` only keys at or before the query.

    Flags [n] with at most ``INLINE_RUNS`` runs of consecutive global positions (the first g tokens, a few
    positions) are tested by comparing positions with the runs' ends: a compiled kernel evaluating the
    predicate per score (FlexAttention's) reads no table. Others look their flags up."""
    is_global = torch.as_tensor(is_global).bool().cpu()  # copied to each device by ``prepare``
    if is_global.dim() not in (1, 2):
        raise ValueError(f"is_global must be bool [n] or [batch, n], got shape {tuple(is_global.shape)}")
    at, any_in, prepare = _lookup(is_global)
    runs = _runs(is_global) if is_global.dim() == 1 else None
    if runs is not None:
        at = _in_runs(runs)

    def pred(b, h, q_idx, kv_idx):
        out = at(b, q_idx) | at(b, kv_idx)
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        if not causal:
            return any_in(b, ql, qh) | any_in(b, kl, kh)
        # a global query q in [max(ql, kl), qh] sees key kl; a global key k in [kl, min(kh, qh)] is seen by qh
        return any_in(b, torch.maximum(ql, kl), qh) | any_in(b, kl, torch.minimum(kh, qh))

    return Mask(pred, tiles, prepare=prepare, name="global_tokens" + ("" if causal else "_bidir"))


def longformer(window: int, is_global: torch.Tensor, dilation=1, causal: bool = True) -> Mask:
    """Longformer's pattern (arXiv:2004.05150): a (dilated) window OR global tokens."""
    mask = or_masks(dilated_window(window, dilation, causal=causal), global_tokens(is_global, causal=causal))
    return mask.named(f"longformer_{window}" + ("" if causal else "_bidir"))
