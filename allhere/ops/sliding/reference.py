"""Dense reference of sliding-window attention, in fp32: the ground truth of the other paths."""

from __future__ import annotations

import torch

from ...masks.predicates import dense_mask, or_masks
from ...masks.segments import segment_sinks
from ...masks.windows import sliding_window, sliding_with_sinks
from ..common import (
    check_qkv,
    check_row_start,
    check_sinks,
    check_window,
    default_scale,
    masked_attention_reference,
    segment_mask,
)


def local_pattern(window: int, sinks: int = 0, row_start: torch.Tensor | None = None, q_offset: int = 0):
    """The mask a local query reads: its ``window`` most recent keys, and with ``sinks`` > 0 the first ``sinks``
    keys of its segment (of the sequence without ``row_start``; ``q_offset``: the absolute position of the first
    query). The one definition of the local branch with sinks, for every reference and masked path."""
    if not sinks:
        return sliding_window(window)
    if row_start is None:
        return sliding_with_sinks(window, sinks)  # with its block tests
    return or_masks(sliding_window(window), segment_sinks(sinks, row_start, q_offset=q_offset))


def sliding_window_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                                       scale: float | None = None, row_start: torch.Tensor | None = None,
                                       key_offset: int = 0, sinks: int = 0) -> torch.Tensor:
    """Each query sees its ``window`` most recent keys, itself included, and the first ``sinks`` keys of its
    segment (attention sinks; of the sequence without ``row_start``). Layout as in ``allhere.ops``.
    row_start: optional int [batch, q_len], per query the absolute position of its segment's first key, -1
    = no key (zero output); key_offset: the absolute position of the first key (a rolling cache that
    dropped older keys). Computed in fp32; returns q's dtype."""
    _, _, lq, d, _, lk = check_qkv(q, k, v)
    check_window(window)
    check_sinks(sinks)
    if sinks and key_offset:
        raise ValueError(f"sinks = {sinks} with key_offset = {key_offset}: the sinks are the first keys of the "
                         "sequence, which a cache that dropped keys no longer holds")
    check_row_start(row_start, q)
    pattern = local_pattern(window, sinks, row_start, key_offset + lk - lq)
    if row_start is None:
        mask = dense_mask(pattern, lq, lk, q.device, key_offset=key_offset)
    else:
        mask = segment_mask(row_start, lq, lk, pattern, key_offset)
    return masked_attention_reference(q, k, v, mask, default_scale(d, scale)).to(q.dtype)
