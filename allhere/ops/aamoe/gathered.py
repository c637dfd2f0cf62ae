"""AA-MoE attention that reads only what was chosen: every (query, chosen resource) pair gathers the m
keys and values of its chunk or expert, the scores of a query's pairs share one softmax (a segmented
softmax over pairs). Work and memory grow with sum_i (B_i + own chunk) x m, not with L x (L + E m).
Plain PyTorch ops, differentiable end to end; equal to ``naive`` in outputs and gradients."""

from __future__ import annotations

import torch

from ..common import default_scale, repeat_kv
from .common import check_aamoe


def aamoe_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor,
                    choice: torch.Tensor, logp: torch.Tensor, chunk: int, own_chunk: bool,
                    scale: float | None = None, q_mem: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``aamoe_attention_naive``."""
    lq, lk, d, experts, n_chunks = check_aamoe(q, k, v, mem_k, mem_v, choice, logp, chunk)
    b, h = q.shape[:2]
    dev = q.device
    pad = n_chunks * chunk - lk  # the context padded to whole chunks: resource r is block r of its row
    ctx_k, ctx_v = (torch.nn.functional.pad(repeat_kv(t, h).float(), (0, 0, 0, pad)) for t in (k, v))
    blocks = n_chunks + experts
    keys = torch.cat([ctx_k, mem_k.float().flatten(1, 2)[None].expand(b, -1, -1, -1)], 2)
    vals = torch.cat([ctx_v, mem_v.float().flatten(1, 2)[None].expand(b, -1, -1, -1)], 2)
    keys, vals = (t.view(b, h, blocks, chunk, d).permute(0, 2, 3, 1, 4).reshape(b * blocks, chunk, h, d)
                  for t in (keys, vals))
    qpos = lk - lq + torch.arange(lq, device=dev)

    bi, ti, ri = (choice >= 0).nonzero(as_tuple=True)  # the chosen (query, rank) pairs
    batch, tok, res, bias = [bi], [ti], [choice[bi, ti, ri]], [logp[bi, ti, ri].float()]
    if own_chunk:  # one more pair per query: its own chunk, bias 0
        ot = torch.arange(lq, device=dev).repeat(b)
        batch, tok, res = batch + [torch.arange(b, device=dev).repeat_interleave(lq)], tok + [ot], res + [qpos[ot] // chunk]
        bias.append(torch.zeros(b * lq, device=dev))
    bi, ti, res, bias = (torch.cat(t) for t in (batch, tok, res, bias))
    is_ctx = (res < n_chunks)[:, None]
    slot = res[:, None] * chunk + torch.arange(chunk, device=dev)  # [P, m] key position (chunks)
    ok = ~is_ctx | ((slot < lk) & (slot <= qpos[ti][:, None]))  # causal inside the context
    block = bi * blocks + res
    kp, vp = keys.index_select(0, block), vals.index_select(0, block)  # [P, m, h, d]
    row = bi * lq + ti  # the query of each pair
    query = q.float().permute(0, 2, 1, 3).reshape(b * lq, h, d).index_select(0, row)
    if q_mem is not None:  # expert slots are read by q_mem
        mem_query = q_mem.float().permute(0, 2, 1, 3).reshape(b * lq, h, d).index_select(0, row)
        query = torch.where(is_ctx[:, :, None], query, mem_query)
    s = torch.einsum("phd,pmhd->phm", query, kp) * default_scale(d, scale) + bias[:, None, None]
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    # segmented softmax over each query's pairs
    top = torch.full((b * lq, h), float("-inf"), device=dev)
    top = top.scatter_reduce(0, row[:, None].expand(-1, h), s.detach().amax(-1), "amax")
    top = torch.where(torch.isfinite(top), top, 0.0)
    e = torch.exp(s - top.index_select(0, row)[..., None])
    den = torch.zeros(b * lq, h, device=dev).index_add(0, row, e.sum(-1))
    num = torch.zeros(b * lq, h, d, device=dev).index_add(0, row, torch.einsum("phm,pmhd->phd", e, vp))
    out = num / torch.where(den > 0, den, 1.0)[..., None]  # a query with no key: 0
    return out.view(b, lq, h, d).permute(0, 2, 1, 3).to(q.dtype)
