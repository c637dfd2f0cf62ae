"""Mechanism ``sliding``: each query sees its ``window`` most recent keys, itself included; the rolling KV
cache keeps only those, so memory stays bounded however long generation runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..masks import sliding_window
from ..ops.sliding import sliding_window_attention
from ..registry import Serving, register
from ..validation import check_int
from .base import AttentionCall, AttentionMechanism, ContextParallelPlan
from .caches import RollingKVCache


@dataclass(frozen=True)
class SlidingConfig:
    """Sliding-window attention: query i sees keys j with 0 <= i - j < window (itself included)."""

    window: int = 256  # number of most recent keys each query sees, the current token included

    kind: str = field(default="sliding", init=False)

    def __post_init__(self) -> None:
        check_int("SlidingConfig", "window", self.window, 1)


# served (allhere.serve): vLLM's own sliding-window layer, on any of its backends
@register(SlidingConfig, summary="the w most recent keys, the current one included",
          serving=Serving("sliding", devices=("cpu", "cuda")))
class SlidingAttention(AttentionMechanism):
    reads_all_keys = False

    def new_cache(self) -> RollingKVCache:
        return RollingKVCache(self.cfg.window)

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        offset = 0 if cache is None else cache.dropped  # absolute position of the first key returned
        if cache is not None:
            k, v = cache.update(k, v)
        return sliding_window_attention(q, k, v, self.cfg.window, call.scale, row_start=call.segment_starts,
                                        key_offset=offset), None

    def context_parallel_plan(self, call: AttentionCall, n: int) -> ContextParallelPlan:
        # the window's block test is exact: the ring reads only the neighbouring chunks within reach
        return ContextParallelPlan(reads=sliding_window(self.cfg.window))
