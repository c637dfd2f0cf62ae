"""Op family ``"all_attention"``: one softmax over the causal context and a head's persistent memory slots, the
attention of the All-Attention layer ("Augmenting Self-attention with Persistent Memory", Sukhbaatar et al. 2019,
arXiv:1907.01470; the mechanism ``all_attention`` calls it through ``allhere.backend``). So far the family has
its reference path only."""

from __future__ import annotations

import torch

from ..masks.predicates import causal, dense_mask
from .common import check_qkv, default_scale, repeat_kv


def all_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mem_k: torch.Tensor,
                            mem_v: torch.Tensor, scale: float | None = None, mask: torch.Tensor | None = None,
                            q_mem: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over [causal context; memory]. q [b, h, lq, d]; k, v [b, kv_heads, lk, d] (queries are the
    last lq positions); mem_k, mem_v [h, n_mem, d]; mask: optional bool [b, 1, lq, lk] over the context
    (True = may attend), causal when None; q_mem: the queries that read the memory (default q). Dense in
    fp32, one softmax over both parts: the reference of op family ``"all_attention"``, so far its only path
    (``allhere.backend``). Returns [b, h, lq, d] in q's dtype."""
    b, h, lq, d, _, lk = check_qkv(q, k, v)
    if mem_k.shape != mem_v.shape or mem_k.shape[0] != h or mem_k.shape[2] != d:
        raise ValueError(f"mem_k and mem_v must be [heads={h}, n_mem, dim={d}], got {tuple(mem_k.shape)}, "
                         f"{tuple(mem_v.shape)}")
    ctx = dense_mask(causal, lq, lk, q.device) if mask is None else mask
    scale = default_scale(d, scale)
    s_ctx = (q.float() @ repeat_kv(k, h).float().transpose(-1, -2) * scale).masked_fill(~ctx, float("-inf"))
    s_mem = (q if q_mem is None else q_mem).float() @ mem_k.float().transpose(-1, -2)[None] * scale
    p = torch.softmax(torch.cat([s_ctx, s_mem], dim=-1), dim=-1)  # the memory is never masked: no empty row
    return (p[..., :lk] @ repeat_kv(v, h).float() + p[..., lk:] @ mem_v.float()[None]).to(q.dtype)
