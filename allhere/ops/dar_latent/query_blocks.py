"""The query-block loop both PyTorch paths of ``"dar_latent"`` share: near keys from the window, far keys
through a path-specific pair of functions, one softmax per block.

A block of queries at positions [p0, p1) reads near keys only from (p0 - w, p1) and far keys only from
[0, p1 - w). Query heads that share a KV head are stacked as rows ([b, kv_heads, group x rows, .]), so every
product is one batched matmul over tensors as they lie: nothing is repeated or copied per head. Scores are
formed in the inputs' dtype, normalised in fp32.
"""

from __future__ import annotations

from typing import Callable

import torch


def attend_in_blocks(q, k_near, v_near, lk: int, window: int, scale: float, mask: torch.Tensor | None,
                     far_logits: Callable, far_out: Callable, block: int) -> torch.Tensor:
    """q [b, h, lq, d]; k_near, v_near [b, kv_heads, ln, d]: the last ln of the lk positions. far_logits(s, e,
    far1) -> [b, kv_heads, group x (e - s), far1] unscaled scores of queries s..e-1 (each head's rows stacked)
    against far keys 0..far1-1; far_out(p, far1) -> [b, kv_heads,
    group x (e - s), d] the far values weighted by p [b, kv_heads, group x (e - s), far1]. mask: optional bool
    [b or 1, 1, lq, lk]. Returns [b, h, lq, d] in q's dtype."""
    b, h, lq, d = q.shape
    g, shift = k_near.shape[1], lk - k_near.shape[2]
    off, group = lk - lq, h // g
    qg = q.view(b, g, group, lq, d)
    out = []
    for s in range(0, lq, block):
        e = min(lq, s + block)
        rows = e - s
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
        kn, vn = (t[:, :, near0 - shift:near1 - shift] for t in (k_near, v_near))
        s_near = qg[:, :, :, s:e].reshape(b, g, group * rows, d) @ kn.transpose(-1, -2)
        logits = torch.cat([s_near, far_logits(s, e, far1)], dim=-1).float() * scale
        logits = logits.view(b, g, group, rows, -1).masked_fill(~allowed, float("-inf"))
        seen = allowed.any(-1, keepdim=True)
        p = torch.where(seen, torch.softmax(logits.masked_fill(~seen, 0.0), dim=-1), 0.0).to(v_near.dtype)
        p_near, p_far = p.view(b, g, group * rows, -1).split([near1 - near0, far1], dim=-1)
        o = p_near @ vn + far_out(p_far, far1)
        out.append(o.view(b, g, group, rows, d))
    return torch.cat(out, dim=3).reshape(b, h, lq, d).to(q.dtype)
