"""Dilated sliding-window attention (Longformer, arXiv:2004.05150) over a whole sequence: the fast path.

A query at position p reads keys p, p - d, ..., p - (w - 1) d: all in p's residue class modulo d. Cut
the sequence into its d residue classes (position p -> class p mod d, index p // d) and the pattern is
an ordinary window of w keys inside each class. So the op permutes q, k, v into classes (one copy),
runs the blocked sliding-window op (``allhere.ops.sliding``; the block-sparse op for an encoder's
two-sided window) with the classes as extra batch rows, and permutes back. Work per query: w keys plus
the blocked op's tile overhead, whatever the dilation, where tiles of the original order would cover the
whole span (w - 1) d + 1.

Per-head dilations: heads are grouped by dilation. Grouped-query heads that share a kv head and a
dilation share its keys; a kv group whose query heads have different dilations has its keys copied per
query head for the heads concerned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks.mask import Mask
from ..masks.predicates import and_masks
from ..masks.windows import sliding_window
from .blocksparse import pattern_attention
from .common import check_qkv
from .sliding.blocked import sliding_window_attention_torch


def _valid_keys(n: int, dilation: int) -> Mask:
    """In class coordinates (batch row b' = batch * d + class): key index j is a real position (< n)."""

    def pred(b, h, q_idx, kv_idx):
        return kv_idx * dilation + b % dilation < n

    def tiles(b, h, ql, qh, kl, kh):  # exact: the rectangle's first key
        return kl * dilation + b % dilation < n

    def dense(b, h, ql, qh, kl, kh):  # exact: its last key
        return kh * dilation + b % dilation < n

    return Mask(pred, tiles, dense, name=f"valid_keys_{n}_{dilation}")


def _one_dilation(q, k, v, window: int, dilation: int, causal: bool, scale, block: int):
    b, h, n, d = q.shape
    if dilation == 1 or n <= 1:
        if causal:
            return sliding_window_attention_torch(q, k, v, window, scale=scale)
        return pattern_attention(q, k, v, sliding_window(window, causal=False), scale, block)
    m = -(-n // dilation)
    pad = m * dilation - n

    def classes(t):  # [b, heads, n, d] -> [b * dilation, heads, m, d]
        t = F.pad(t, (0, 0, 0, pad)).view(t.shape[0], t.shape[1], m, dilation, d)
        return t.permute(0, 3, 1, 2, 4).reshape(t.shape[0] * dilation, t.shape[1], m, d)

    qc, kc, vc = classes(q), classes(k), classes(v)
    if causal:  # padding sits at the end: later than every real query, never read by one
        oc = sliding_window_attention_torch(qc, kc, vc, window, scale=scale)
    else:
        pred = and_masks(sliding_window(window, causal=False), _valid_keys(n, dilation))
        oc = pattern_attention(qc, kc, vc, pred, scale, block)
    out = oc.view(b, dilation, h, m, d).permute(0, 2, 3, 1, 4).reshape(b, h, m * dilation, d)
    return out[:, :, :n]


def dilated_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dilation=1,
                             causal: bool = True, scale: float | None = None, block: int = 64) -> torch.Tensor:
    """Attention under ``allhere.masks.dilated_window(window, dilation, causal)`` for a whole sequence
    (q_len == kv_len, positions from 0). ``dilation``: an int or one int per query head."""
    _, h, n, _, hkv, lk = check_qkv(q, k, v)
    if n != lk:
        raise ValueError(f"dilated_window_attention takes a whole sequence (q_len == kv_len); got {n} and {lk}")
    dils = tuple(dilation) if isinstance(dilation, (tuple, list)) else (dilation,) * h
    if len(dils) != h:
        raise ValueError(f"{len(dils)} dilations for {h} heads")
    if len(set(dils)) == 1:
        return _one_dilation(q, k, v, window, dils[0], causal, scale, block)
    g = h // hkv
    parts, order = [], []
    for dv in sorted(set(dils)):
        heads = [i for i, x in enumerate(dils) if x == dv]
        kvs = sorted({i // g for i in heads})
        if heads == [kv * g + j for kv in kvs for j in range(g)]:  # whole kv groups: share their keys
            ks, vs = k[:, kvs], v[:, kvs]
        else:  # each query head gets its kv head's keys (copied for these heads only)
            idx = torch.tensor([i // g for i in heads], device=k.device)
            ks, vs = k.index_select(1, idx), v.index_select(1, idx)
        parts.append(_one_dilation(q[:, heads], ks, vs, window, dv, causal, scale, block))
        order += heads
    inverse = torch.empty(h, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(h)
    return torch.cat(parts, 1)[:, inverse.to(q.device)]
