"""``sliding_window_attention``: the entry of op family ``"sliding"``, routed by backend (``allhere.backend``):
"reference" computes densely in fp32 (``reference``), every other backend runs the blocked PyTorch path
(``blocked``)."""

from __future__ import annotations

import torch

from ...backend import dispatch


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             scale: float | None = None, row_start: torch.Tensor | None = None,
                             key_offset: int = 0, backend: str | None = None, sinks: int = 0) -> torch.Tensor:
    """Each query sees its ``window`` most recent keys, itself included (window ``w``: ``0 <= q_idx - kv_idx
    < w``). q [batch, heads, q_len, dim]; k, v [batch, kv_heads, kv_len, dim]; the queries are the last q_len
    keys. row_start: optional int [batch, q_len], per query the absolute position of its segment's first key
    (-1 = no key, zero output); key_offset: the absolute position of the first key (a rolling cache). sinks:
    each query also sees the first ``sinks`` keys of its segment (attention sinks, absolute positions).
    backend: as ``allhere.backend``; None = the innermost ``use_backend`` block. Returns q's dtype."""
    return dispatch("sliding", q, k, v, window, scale, row_start, key_offset, backend=backend, sinks=sinks)
