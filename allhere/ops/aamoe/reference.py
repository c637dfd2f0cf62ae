"""Dense reference of AA-MoE attention: every key of the context and every expert slot scored, the
routing a mask plus the log P(i, j_k) bias of Eq. 16. fp32; the ground truth of ``gathered``."""

from __future__ import annotations

import torch

from ..common import default_scale, repeat_kv
from .common import check_aamoe


def aamoe_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mem_k: torch.Tensor,
                              mem_v: torch.Tensor, choice: torch.Tensor, logp: torch.Tensor, chunk: int,
                              own_chunk: bool, scale: float | None = None,
                              q_mem: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, h, lq, d]; k, v [b, kv_heads, lk, d] (queries = the last lq positions); mem_k, mem_v
    [h, E, chunk, d]; choice, logp [b, lq, K] (``allhere.ops.aamoe.common``); q_mem: the queries that
    read the expert slots (default q). A query with no key at all returns 0 (the residual passes
    through). Returns [b, h, lq, d] in q's dtype."""
    lq, lk, d, experts, n_chunks = check_aamoe(q, k, v, mem_k, mem_v, choice, logp, chunk)
    b, h = q.shape[:2]
    n_res = n_chunks + experts
    # per (query, resource) bias; unused ranks land in a spare last column that is dropped
    slot = torch.where(choice >= 0, choice, n_res)
    res_bias = torch.full((b, lq, n_res + 1), float("-inf"), device=q.device)
    res_bias = res_bias.scatter(-1, slot, logp.float())[..., :n_res]
    key_res = torch.cat([torch.arange(lk, device=q.device) // chunk,
                         n_chunks + torch.arange(experts * chunk, device=q.device) // chunk])
    bias = res_bias[..., key_res]  # [b, lq, lk + E m]
    qpos = (lk - lq + torch.arange(lq, device=q.device))[:, None]
    kpos = torch.arange(lk, device=q.device)[None, :]
    ctx = bias[..., :lk].masked_fill(kpos > qpos, float("-inf"))  # never a key after the query
    if own_chunk:
        own = (kpos // chunk == qpos // chunk) & (kpos <= qpos)
        ctx = torch.where(own, 0.0, ctx)
    bias = torch.cat([ctx, bias[..., lk:]], dim=-1)
    vals = torch.cat([repeat_kv(v, h).float(), mem_v.float().flatten(1, 2)[None].expand(b, -1, -1, -1)], 2)
    s_ctx = q.float() @ repeat_kv(k, h).float().transpose(-1, -2)
    s_mem = (q if q_mem is None else q_mem).float() @ mem_k.float().flatten(1, 2).transpose(-1, -2)[None]
    s = torch.cat([s_ctx, s_mem], -1) * default_scale(d, scale) + bias[:, None]
    seen = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.where(seen, torch.softmax(s.masked_fill(~seen, 0.0), dim=-1), 0.0)
    return (p @ vals).to(q.dtype)
