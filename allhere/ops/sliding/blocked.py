"""Sliding-window attention in query blocks: the "torch" path (CPU and GPU, any dtype, differentiable).

Queries are cut into blocks of ``block`` rows. A block only needs the ``block + window - 1`` keys that
end at its last query, so every block runs one small dense SDPA over its own key slab (built with
``unfold``, a view of the padded keys) and a mask that is the same for every block apart from the
padding in front of the first keys. Work per query is ``block + window - 1`` keys instead of the whole
prefix. Grouped-query heads that share a kv head are stacked as extra query rows of the same block, so
keys are never copied per query head.

Sinks (``sinks`` > 0, the first keys every query also reads): the sink keys are put in front of every block's
slab (a few keys copied per block) with a mask that admits each only where the window does not already hold it.

Up to ``DENSE_UP_TO`` keys one SDPA call under the band mask is faster than the blocks, forward and
backward (measured on the CPU: T = 256, w = 32, B = 16, 6 heads of 32: 92 ms against 168 ms for forward +
backward; at 1024 keys and w = 128 the blocks win), so short sequences take that call unless a block size
is asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks.predicates import dense_mask
from ..common import check_qkv, check_row_start, check_sinks, check_window, default_scale, segment_mask
from ..full import masked_attention
from .reference import local_pattern

DENSE_UP_TO = 512  # keys: up to this many, one dense SDPA call under the band mask


def sliding_window_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                                   scale: float | None = None, row_start: torch.Tensor | None = None,
                                   key_offset: int = 0, block: int | None = None, sinks: int = 0) -> torch.Tensor:
    """Same contract as ``sliding_window_attention_reference``; output in q's dtype. With ``row_start`` one
    SDPA call under the window within the segments.

    block: query rows per block (default ``min(window, 64)``, at least 1, at most q_len); given, the blocks
    are used whatever the length (default: one dense call up to ``DENSE_UP_TO`` keys).
    """
    b, h, lq, d, hkv, lk = check_qkv(q, k, v)
    check_window(window)
    check_sinks(sinks)
    if sinks and key_offset:
        raise ValueError(f"sinks = {sinks} with key_offset = {key_offset}: the sinks are the first keys of the "
                         "sequence, which a cache that dropped keys no longer holds")
    check_row_start(row_start, q)
    scale = default_scale(d, scale)
    if row_start is not None:
        pattern = local_pattern(window, sinks, row_start, key_offset + lk - lq)
        return masked_attention(q, k, v, segment_mask(row_start, lq, lk, pattern, key_offset), scale)
    g = h // hkv
    ns = min(sinks, max(0, lk - window))  # sinks that lie before the last query's window
    if block is None and lq == 1:  # a decode step: the last w keys, read in place (and the sinks before them)
        ks, vs = (t[:, :, max(0, lk - window):] for t in (k, v))
        if ns:
            ks, vs = torch.cat([k[:, :, :ns], ks], 2), torch.cat([v[:, :, :ns], vs], 2)
        return F.scaled_dot_product_attention(q, ks, vs, scale=scale, enable_gqa=g > 1)
    if block is None and lk <= DENSE_UP_TO:
        mask = dense_mask(local_pattern(window, sinks), lq, lk, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1)
    w = min(window, lk)  # a window longer than the keys is the keys
    bq = max(1, min(block or min(w, 64), lq))
    nb = -(-lq // bq)
    bk = bq + w - 1
    off = lk - lq  # absolute position of query 0
    # Keys: slab i covers absolute positions [off - (w - 1) + i*bq, off + i*bq + bq - 1].
    start = off - (w - 1)
    pad_front = max(0, -start)
    need = nb * bq + w - 1  # length of the padded key sequence
    ks, vs = (t[:, :, max(0, start):] for t in (k, v))
    pad_back = need - pad_front - ks.shape[2]
    ks, vs = (F.pad(t, (0, 0, pad_front, pad_back)) for t in (ks, vs))
    ks, vs = (t.unfold(2, bk, bq).transpose(-1, -2) for t in (ks, vs))  # [b, hkv, nb, bk, d]
    # Queries: [b, hkv, g, lq, d] -> blocks [b, hkv, nb, g*bq, d]
    qb = F.pad(q, (0, 0, 0, nb * bq - lq)).view(b, hkv, g, nb, bq, d).permute(0, 1, 3, 2, 4, 5)
    qb = qb.reshape(b * hkv, nb, g * bq, d)
    # Mask: query a of block i (abs off + i*bq + a) sees slab key c (abs start + i*bq + c) iff
    # 0 <= (a + w - 1 - c) < w and the key is not front padding.
    a = torch.arange(bq, device=q.device).view(1, -1, 1)
    c = torch.arange(bk, device=q.device).view(1, 1, -1)
    i = torch.arange(nb, device=q.device).view(-1, 1, 1)
    mask = (c >= a) & (c <= a + w - 1) & (start + i * bq + c >= 0)  # [nb, bq, bk]
    ks, vs = ks.reshape(b * hkv, nb, bk, d), vs.reshape(b * hkv, nb, bk, d)
    if ns:  # sink key j for query p = off + i*bq + a: j <= p and outside its window (p - j >= w)
        p = off + i * bq + a
        j = torch.arange(ns, device=q.device).view(1, 1, -1)
        mask = torch.cat([(j <= p) & (p - j >= w), mask], -1)
        ks, vs = (torch.cat([t[:, :, :ns].reshape(b * hkv, 1, ns, d).expand(-1, nb, -1, -1), slab], 2)
                  for t, slab in ((k, ks), (v, vs)))
    mask = mask.unsqueeze(1).expand(nb, g, bq, mask.shape[-1]).reshape(1, nb, g * bq, mask.shape[-1])
    o = F.scaled_dot_product_attention(qb, ks, vs, attn_mask=mask, scale=scale)
    o = o.view(b, hkv, nb, g, bq, d).permute(0, 1, 3, 2, 4, 5).reshape(b, h, nb * bq, d)
    return o[:, :, :lq]
