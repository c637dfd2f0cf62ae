"""Causal attention over the whole prefix, and attention under any boolean mask, through PyTorch SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import MaskFn, and_masks, causal, dense_mask, within_segments
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


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """SDPA under a bool mask broadcastable to [b, h, q_len, kv_len] (True = may attend); a query that
    may see no key gets 0 (SDPA alone would give NaN)."""
    b, h, lq, d, hkv, lk = check_qkv(q, k, v)
    seen = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~seen, scale=default_scale(d, scale),
                                         enable_gqa=h != hkv)
    return out * seen.to(out.dtype)


def segment_pattern(pattern: MaskFn, starts: torch.Tensor, q_len: int, kv_len: int, key_offset: int = 0) -> torch.Tensor:
    """bool [b, 1, q_len, kv_len]: ``pattern`` (a predicate on absolute positions) within the segments
    ``starts`` [b, q_len] (absolute positions, -1 = nothing). ``key_offset``: absolute position of the
    first key (a rolling cache that dropped older keys); queries are the last q_len positions."""
    b, device = starts.shape[0], starts.device
    q_first = key_offset + kv_len - q_len
    pred = and_masks(pattern, within_segments(starts, q_offset=q_first))
    bi = torch.arange(b, device=device).view(-1, 1, 1, 1)
    qi = torch.arange(q_len, device=device).view(1, 1, -1, 1) + q_first
    ki = torch.arange(kv_len, device=device).view(1, 1, 1, -1) + key_offset
    return pred(bi, 0, qi, ki).expand(b, 1, q_len, kv_len)
