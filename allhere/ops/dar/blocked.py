"""DAR attention in query blocks: the "torch" path (CPU and GPU, any dtype, differentiable).

The reference builds two full [q, k] score matrices (near and far) and masks half of each away. Here
queries are cut into blocks; a block at positions [p0, p1) needs near keys only from (p0 - w, p1) and far
keys only from [0, p1 - w), so it runs one SDPA over those two key ranges, concatenated, with a mask
from the same predicates (near: 0 <= i - j < w; far: i - j >= w). Work per query is about its prefix
plus the window, once, instead of twice the whole key length; memory is one block's scores. Query heads
that share a kv head are stacked as extra rows of the block, so keys are never copied per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import check_qkv, default_scale


def dar_attention_torch(q: torch.Tensor, k_near: torch.Tensor, v_near: torch.Tensor, k_far: torch.Tensor,
                        v_far: torch.Tensor, window: int, scale: float | None = None, mask: torch.Tensor | None = None,
                        block: int = 256) -> torch.Tensor:
    """Same contract as ``dar_attention_reference``; output in q's dtype.

    mask: optional bool [b or 1, 1, q_len, kv_len] (True = may attend, e.g. padding), combined with the
    causal near/far split; a query that may see no key gets 0. block: query rows per block.
    """
    b, h, lq, d, hkv, lk = check_qkv(q, k_near, v_near)
    check_qkv(q, k_far, v_far)
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (lq, lk)):
        raise ValueError(f"mask must be bool [batch, 1, q_len={lq}, kv_len={lk}], got {tuple(mask.shape)}")
    scale = default_scale(d, scale)
    g, off = h // hkv, lk - lq
    qg = q.view(b, hkv, g, lq, d)
    out = []
    for s in range(0, lq, block):
        e = min(lq, s + block)
        near0 = max(0, off + s - window + 1)  # first key some query of the block sees as near
        near1 = off + e if window > 0 else near0  # window 0: no near keys
        far1 = max(0, off + e - window)  # keys before this are far for some query of the block
        pos = torch.arange(off + s, off + e, device=q.device).view(-1, 1)
        jn = torch.arange(near0, near1, device=q.device).view(1, -1)
        jf = torch.arange(0, far1, device=q.device).view(1, -1)
        allowed = torch.cat([(jn <= pos) & (pos - jn < window), pos - jf >= window], dim=1)  # [rows, keys]
        keys = torch.cat([k_near[:, :, near0:near1], k_far[:, :, :far1]], dim=2)
        values = torch.cat([v_near[:, :, near0:near1], v_far[:, :, :far1]], dim=2)
        allowed = allowed.view(1, 1, e - s, -1)
        if mask is not None:
            outer = torch.cat([mask[..., s:e, near0:near1], mask[..., s:e, :far1]], dim=-1)
            allowed = allowed & outer
        seen = allowed.any(-1, keepdim=True)  # [b?, 1, rows, 1]
        allowed = allowed | ~seen  # a row with nothing to see attends to all and is zeroed below
        rows = e - s
        qb = qg[:, :, :, s:e].reshape(b, hkv, g * rows, d)
        m = allowed.unsqueeze(2).expand(allowed.shape[0], 1, g, rows, allowed.shape[-1])
        m = m.reshape(allowed.shape[0], 1, g * rows, -1)
        o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=m, scale=scale)
        o = o.view(b, hkv, g, rows, d)
        if mask is not None:
            o = o * seen.unsqueeze(2).to(o.dtype)
        out.append(o)
    return torch.cat(out, dim=3).view(b, h, lq, d)
