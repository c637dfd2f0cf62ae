"""Dense reference of DAR attention (Eqs. 1-4 of the DAR paper, arXiv:2606.18587): one softmax over near and far
keys, in fp32."""

from __future__ import annotations

import torch

from ...masks.predicates import causal, dense_mask
from ...masks.windows import sliding_window
from ..common import check_qkv, default_scale, repeat_kv


def dar_attention_reference(q: torch.Tensor, k_near: torch.Tensor, v_near: torch.Tensor, k_far: torch.Tensor,
                            v_far: torch.Tensor, window: int, scale: float | None = None,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Query i reads key/value j from (k_near, v_near) when i - j < window, from (k_far, v_far) otherwise
    (j <= i always). q [b, h, lq, d]; the four key/value tensors [b, kv_heads, lk, d] over the same
    positions; queries are the last lq positions. window = 0: every key is far. mask: optional bool,
    broadcastable to [b, h, lq, lk], True = may attend; a query that may see no key gives 0. In fp32."""
    _, h, lq, d, _, lk = check_qkv(q, k_near, v_near)
    check_qkv(q, k_far, v_far)
    scale = default_scale(d, scale)
    causal_m = dense_mask(causal, lq, lk, q.device)
    near_m = dense_mask(sliding_window(window), lq, lk, q.device) if window > 0 else torch.zeros_like(causal_m)
    far_m = causal_m & ~near_m
    if mask is not None:
        near_m, far_m = near_m & mask, far_m & mask
    qf = q.float()
    s_near = (qf @ repeat_kv(k_near, h).float().transpose(-1, -2) * scale).masked_fill(~near_m, float("-inf"))
    s_far = (qf @ repeat_kv(k_far, h).float().transpose(-1, -2) * scale).masked_fill(~far_m, float("-inf"))
    s = torch.cat([s_near, s_far], dim=-1)
    seen = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.where(seen, torch.softmax(s.masked_fill(~seen, 0.0), dim=-1), 0.0)
    v = torch.cat([repeat_kv(v_near, h), repeat_kv(v_far, h)], dim=2).float()
    return (p @ v).to(q.dtype)
