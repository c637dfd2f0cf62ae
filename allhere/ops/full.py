"""Causal attention over the whole prefix, attention under any boolean mask, and the dense reference of any
mask predicate (``allhere.masks``), through PyTorch SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import MaskFn, causal, dense_mask
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


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pred: MaskFn, scale: float | None = None,
                        key_offset: int = 0) -> torch.Tensor:
    """The dense reference of a pattern: ``masked_attention`` under ``dense_mask(pred)``, the keys at absolute
    positions ``key_offset`` .. and the queries the last q_len of them. The fast paths of a predicate
    (``allhere.ops.blocksparse``, ``allhere.ops.flex``) are tested against it."""
    b, h, lq = q.shape[:3]
    mask = dense_mask(pred, lq, k.shape[2], q.device, batch=b, heads=h, key_offset=key_offset)
    return masked_attention(q, k, v, mask, scale)
