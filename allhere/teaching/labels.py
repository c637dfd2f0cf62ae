"""What reading locally costs a (token, head), measured on the full model's own attention: the labels a router is
taught from (``allhere.teaching``).

Two measures, both from one pass of the model with every gate global (its own attention, the teacher):

- ``"mass"``: the share of the head's attention that falls beyond its local keys (the window and the sinks);
- ``"output"``: how far the head's output moves when it reads locally, ``||a_full - a_local||`` (the local
  attention renormalised over the window and the sinks), relative to ``||a_full||``.

Computed densely in float32, one sequence at a time (a [heads, n, n] score matrix at a time).
"""

from __future__ import annotations

import torch

from ..masks import dense_mask
from ..ops.common import default_scale, repeat_kv
from ..ops.sliding.reference import local_pattern

LABELS = ("mass", "output")


@torch.no_grad()
def local_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, sinks: int = 0,
               scale: float | None = None, label: str = "output") -> torch.Tensor:
    """Per (batch, head, query) what reading locally costs: float32 [batch, heads, q_len]. q [batch, heads, q_len,
    dim], k and v [batch, kv_heads, kv_len, dim] (grouped-query heads repeated here), the queries the last q_len
    of the keys, every key of the sequence (no padding); ``label`` one of ``LABELS``. A query whose whole prefix
    is local costs 0 under both."""
    if label not in LABELS:
        raise ValueError(f"label must be one of {LABELS}, got {label!r}")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    scale = default_scale(d, scale)
    full = dense_mask(lambda b_, h_, i, j: j <= i, lq, lk, q.device)[0, 0]
    local = dense_mask(local_pattern(window, sinks), lq, lk, q.device)[0, 0]
    out = torch.empty(b, h, lq, device=q.device)
    for i in range(b):
        kk, vv = repeat_kv(k[i:i + 1], h)[0].float(), repeat_kv(v[i:i + 1], h)[0].float()
        s = (q[i].float() @ kk.transpose(-1, -2)) * scale  # [h, lq, lk]
        p_full = torch.softmax(s.masked_fill(~full, float("-inf")), -1)
        if label == "mass":
            out[i] = (p_full * ~local).sum(-1)
            continue
        p_local = torch.softmax(s.masked_fill(~local, float("-inf")), -1)
        a_full, a_local = p_full @ vv, p_local @ vv
        out[i] = (a_full - a_local).norm(dim=-1) / a_full.norm(dim=-1).clamp_min(1e-6)
    return out
