"""Dense reference of sliding-window attention."""

from __future__ import annotations

import torch

from ...masks import dense_mask, sliding_window
from ..common import check_qkv, check_window, default_scale, masked_attention_fp32


def sliding_window_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                                   scale: float | None = None) -> torch.Tensor:
    """Each query sees its ``window`` most recent keys, itself included. Layout as in ``allhere.ops``."""
    _, _, lq, d, _, lk = check_qkv(q, k, v)
    check_window(window)
    mask = dense_mask(sliding_window(window), lq, lk, q.device)
    return masked_attention_fp32(q, k, v, mask, default_scale(d, scale)).to(q.dtype)
