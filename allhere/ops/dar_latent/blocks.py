"""The query-block loop both PyTorch paths of ``"dar_latent"`` share: near keys from the window, far keys
through a path-specific pair of functions, one softmax per block.

A block of queries at positions [p0, p1) reads near keys only from (p0 - w, p1) and far keys only from
[0, p1 - w). Query heads that share a KV head are stacked ([b, kv_heads, group, rows, .]), so nothing is
repeated per head. Scores are formed in the inputs' dtype, normalised in fp32.
"""

from __future__ import annotations

from typing import Callable

import torch


def attend_in_blocks(q, k_near, v_near, lk: int, window: int, scale: float, mask: torch.Tensor | None,
                     far_logits: Callable, far_out: Callable, block: int) -> torch.Tensor:
    """q [b, h, lq, d]; k_near, v_near [b, kv_heads, lk, d]. far_logits(s, e, far1) -> [b, kv_heads, group,
    e - s, far1] unscaled scores of queries s..e-1 against far keys 0..far1-1; far_out(p, s, e, far1) ->
    [b, kv_heads, group, e - s, d] the far values weighted by p [b, kv_heads, group, e - s, far1]. mask: optional
    bool [b or 1, 1, lq, lk]. Returns [b, h, lq, d] in q's dtype."""
    b, h, lq, d = q.shape
    g = k_near.shape[1]
    off = lk - lq
    qg = q.view(b, g, h // g, lq, d)
    out = []
    for s in range(0, lq, block):
        e = min(lq, s + block)
        near0 = max(0, off + s - window + 1)
        near1 = off + e if window > 0 else near0
        far1 = max(0, off + e - window)
        pos = torch.arange(off + s, off + e, device=q.device).view(-1, 1)
        jn = torch.arange(near0, near1, device=q.device).view(1, -1)
        jf = torch.arange(0, far1, device=q.device).view(1, -1)
        allowed = torch.cat([(jn <= pos) & (pos - jn < window), pos - jf >= window], dim=1)[None, None]
        if mask is not None:
            allowed = allowed & torch.cat([mask[..., s:e, near0:near1], mask[..., s:e, :far1]], dim=-1)
        allowed = allowed.unsqueeze(2)  # [b?, 1, 1, rows, keys]: broadcast over kv heads and the group
        s_near = qg[:, :, :, s:e] @ k_near[:, :, None, near0:near1].transpose(-1, -2)
        logits = torch.cat([s_near, far_logits(s, e, far1)], dim=-1).float() * scale
        logits = logits.masked_fill(~allowed, float("-inf"))
        seen = allowed.any(-1, keepdim=True)
        p = torch.where(seen, torch.softmax(logits.masked_fill(~seen, 0.0), dim=-1), 0.0).to(v_near.dtype)
        p_near, p_far = p.split([near1 - near0, far1], dim=-1)
        o = p_near @ v_near[:, :, None, near0:near1] + far_out(p_far, s, e, far1)
        out.append(o)
    return torch.cat(out, dim=3).reshape(b, h, lq, d).to(q.dtype)
