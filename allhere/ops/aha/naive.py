"""Dense reference of All-or-Here attention (seeds/003 Eq. 4). The ground truth for every fast path."""

from __future__ import annotations

import torch

from ...masks import causal, dense_mask, sliding_window
from ..common import (check_gate, check_qkv, check_window, combine_gated, default_scale, hard_gate,
                      masked_attention_fp32)


def aha_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                        scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """All-or-Here attention, computed densely in fp32.

    q: [batch, heads, q_len, dim]; k, v: [batch, kv_heads, kv_len, dim] (heads % kv_heads == 0);
    queries are the last q_len positions. gate: [batch, heads, q_len], bool or 0/1; 1 = full causal
    attention over the whole prefix, 0 = the ``window`` most recent keys, the current one included.
    A float gate that requires grad is treated as straight-through (see ``combine_gated``).
    mask: optional bool, broadcastable to [batch, heads, q_len, kv_len], ANDed with both patterns (padding,
    packed documents); a query that may see no key gets a zero output.
    Returns [batch, heads, q_len, dim] in q's dtype.
    """
    _, _, lq, d, _, lk = check_qkv(q, k, v)
    check_gate(gate, q)
    check_window(window)
    scale = default_scale(d, scale)
    full, local = dense_mask(causal, lq, lk, q.device), dense_mask(sliding_window(window), lq, lk, q.device)
    if mask is not None:
        full, local = full & mask, local & mask
    a_full = masked_attention_fp32(q, k, v, full, scale)
    a_local = masked_attention_fp32(q, k, v, local, scale)
    return combine_gated(hard_gate(gate), gate, a_full, a_local).to(q.dtype)
