"""Causal attention over the whole prefix through PyTorch SDPA (the fastest backend it has)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import causal, dense_mask
from .common import check_qkv, default_scale


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention with queries aligned to the last q_len keys. Layout as in ``allhere.ops``."""
    b, h, lq, d, hkv, lk = check_qkv(q, k, v)
    scale = default_scale(d, scale)
    gqa = h != hkv
    if lq == lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if lq == 1:  # one decode step sees every key
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    mask = dense_mask(causal, lq, lk, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
