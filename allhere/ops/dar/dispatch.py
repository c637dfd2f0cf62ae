"""``dar_attention``: the entry of op family ``"dar"``, routed by backend (``allhere.backend``): "reference"
computes densely in fp32 (``reference``), every other backend runs the blocked PyTorch path (``blocked``)."""

from __future__ import annotations

import torch

from ...backend import dispatch


def dar_attention(q: torch.Tensor, k_near: torch.Tensor, v_near: torch.Tensor, k_far: torch.Tensor,
                  v_far: torch.Tensor, window: int, scale: float | None = None, mask: torch.Tensor | None = None,
                  backend: str | None = None) -> torch.Tensor:
    """DAR attention (Eqs. 1-4 of arXiv:2606.18587): query i reads key/value j from (k_near, v_near) when
    i - j < window, from (k_far, v_far) otherwise (j <= i), one softmax over both. q [b, h, lq, d]; the four
    key/value tensors [b, kv_heads, lk, d] over the same positions; queries are the last lq positions.
    window = 0: every key is far. mask: optional bool [b or 1, 1, lq, lk], True = may attend (a query that
    may see no key gives 0). backend: as ``allhere.backend``; None = the innermost ``use_backend`` block.
    Returns q's dtype."""
    return dispatch("dar", q, k_near, v_near, k_far, v_far, window, scale, mask, backend=backend)
