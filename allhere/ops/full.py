"""Causal attention over the whole prefix (op family ``"full"``), attention under any boolean mask, and the
dense reference of any mask predicate (``allhere.masks``).

``full_attention`` is the family's entry, routed by backend (``allhere.backend``): ``"reference"`` computes
densely in fp32 (``full_attention_reference``), every other backend through PyTorch SDPA
(``full_attention_torch``). ``causal_attention`` and ``masked_attention`` are the SDPA calls themselves,
for the fast paths of other ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._deprecated import moved_names
from ..backend import dispatch
from ..masks.mask import MaskFn
from ..masks.predicates import causal, dense_mask
from .common import check_qkv, default_scale, masked_attention_reference


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


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   mask: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention, or attention under ``mask`` (bool, broadcastable to [b, h, q_len, kv_len], True =
    may attend; a query that may see no key gets 0). Layout as in ``allhere.ops``; queries are the last
    q_len of the keys. backend: as ``allhere.backend``; None = the innermost ``use_backend`` block.
    Returns [b, h, q_len, d] in q's dtype."""
    return dispatch("full", q, k, v, scale, mask, backend=backend)


def full_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                             mask: torch.Tensor | None = None) -> torch.Tensor:
    """``full_attention`` computed densely in fp32."""
    _, _, lq, d, _, lk = check_qkv(q, k, v)
    mask = dense_mask(causal, lq, lk, q.device) if mask is None else mask
    return masked_attention_reference(q, k, v, mask, default_scale(d, scale)).to(q.dtype)


def full_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """``full_attention`` through SDPA, in q's dtype."""
    return causal_attention(q, k, v, scale) if mask is None else masked_attention(q, k, v, mask, scale)


def pattern_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pred: MaskFn,
                                scale: float | None = None, key_offset: int = 0) -> torch.Tensor:
    """The dense reference of attention under a mask predicate, in fp32 (output in q's dtype): the keys at
    absolute positions ``key_offset`` .., the queries the last q_len of them. The fast paths of a predicate
    (``allhere.ops.blocksparse``, ``allhere.ops.flex``) are tested against it."""
    b, h, lq = q.shape[:3]
    mask = dense_mask(pred, lq, k.shape[2], q.device, batch=b, heads=h, key_offset=key_offset)
    return full_attention_reference(q, k, v, scale, mask)


__getattr__ = moved_names(__name__, {"reference_attention": (__name__, "pattern_attention_reference")})
