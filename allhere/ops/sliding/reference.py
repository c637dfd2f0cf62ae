"""Dense reference of sliding-window attention, in fp32: the ground truth of the other paths."""

from __future__ import annotations

import torch

from ...masks import dense_mask, sliding_window
from ..common import check_qkv, check_row_start, check_window, default_scale, masked_attention_reference, segment_mask


def sliding_window_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                                       scale: float | None = None, row_start: torch.Tensor | None = None,
                                       key_offset: int = 0) -> torch.Tensor:
    """Each query sees its ``window`` most recent keys, itself included. Layout as in ``allhere.ops``.
    row_start: optional int [batch, q_len], per query the absolute position of its segment's first key, -1
    = no key (zero output); key_offset: the absolute position of the first key (a rolling cache that
    dropped older keys). Computed in fp32; returns q's dtype."""
    _, _, lq, d, _, lk = check_qkv(q, k, v)
    check_window(window)
    check_row_start(row_start, q)
    if row_start is None:
        mask = dense_mask(sliding_window(window), lq, lk, q.device)
    else:
        mask = segment_mask(row_start, lq, lk, sliding_window(window), key_offset)
    return masked_attention_reference(q, k, v, mask, default_scale(d, scale)).to(q.dtype)
