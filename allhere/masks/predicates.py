"""The causal mask, the ``and`` / ``or`` combinators (which combine every piece of block information of
their parts), and ``dense_mask``, which evaluates any predicate on a grid of positions."""

from __future__ import annotations

import torch

from .mask import Mask, MaskFn, as_mask


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


causal = Mask(
    _causal,
    tiles=lambda b, h, ql, qh, kl, kh: kl <= qh,  # exact: the rectangle's corner (qh, kl)
    dense=lambda b, h, ql, qh, kl, kh: kh <= ql,  # exact: its corner (ql, kh)
    name="causal")


def and_masks(*masks: MaskFn | Mask) -> Mask:
    """The entries every part allows. ``tiles``: the AND of the parts' (a superset still: the parts may
    allow different entries of a rectangle); ``dense``: the AND of the parts' (exact where theirs are:
    a rectangle is whole under the AND iff it is under every part)."""
    parts = [as_mask(m) for m in masks]
    fns = tuple(p.pred for p in parts)

    def pred(b, h, q_idx, kv_idx):
        out = fns[0](b, h, q_idx, kv_idx)
        for f in fns[1:]:
            out = out & f(b, h, q_idx, kv_idx)
        return out

    return _combined(pred, parts, torch.logical_and, "and")


def or_masks(*masks: MaskFn | Mask) -> Mask:
    """The entries some part allows. ``tiles``: the OR of the parts' (exact where theirs are); ``dense``:
    the OR of the parts' (a subset: a rectangle may be covered by several parts together)."""
    parts = [as_mask(m) for m in masks]
    fns = tuple(p.pred for p in parts)

    def pred(b, h, q_idx, kv_idx):
        out = fns[0](b, h, q_idx, kv_idx)
        for f in fns[1:]:
            out = out | f(b, h, q_idx, kv_idx)
        return out

    return _combined(pred, parts, torch.logical_or, "or")


def _combined(pred: MaskFn, parts: list[Mask], combine, word: str) -> Mask:
    """``pred`` with its parts' block tests combined by ``combine`` (None where a part has none: an OR's
    ``dense`` then stays None too, since one that ignores a part would hide the whole blocks a consumer
    finds exactly by evaluating the predicate), their ``prepare`` hooks all run, and ``per_head`` if any
    part varies by head."""
    prepares = [p.prepare for p in parts if p.prepare is not None]

    def prepare(heads: int, length: int, device=None) -> None:
        for f in prepares:
            f(heads, length, device)

    return Mask(pred, tiles=_block_test([p.tiles for p in parts], combine),
                dense=_block_test([p.dense for p in parts], combine), per_head=any(p.per_head for p in parts),
                prepare=prepare if prepares else None, name=f"{word}({', '.join(p.name for p in parts)})")


def _block_test(tests, combine):
    if any(t is None for t in tests):
        return None

    def test(b, h, ql, qh, kl, kh):
        out = tests[0](b, h, ql, qh, kl, kh)
        for t in tests[1:]:
            out = combine(out, t(b, h, ql, qh, kl, kh))
        return out

    return test


def check_count(name: str, value, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``, else ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def dense_mask(pred: MaskFn | Mask, q_len: int, kv_len: int, device=None, q_offset: int | None = None,
               batch: int = 1, heads: int = 1, key_offset: int = 0) -> torch.Tensor:
    """Evaluate ``pred`` on a grid: bool tensor [batch, heads, q_len, kv_len].

    The keys sit at absolute positions ``key_offset`` .. ``key_offset + kv_len - 1`` (a rolling cache that
    dropped older keys has ``key_offset`` > 0); the queries are the last ``q_len`` of them (bottom-right
    alignment, as in a KV cache) unless ``q_offset`` says where the first query sits.
    """
    off = key_offset + kv_len - q_len if q_offset is None else q_offset
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1) + off
    k = torch.arange(kv_len, device=device).view(1, 1, 1, -1) + key_offset
    return pred(b, h, q, k).expand(batch, heads, q_len, kv_len)
