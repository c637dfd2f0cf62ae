"""Mechanism ``full``: ordinary causal attention over the whole prefix."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import masks
from ..ops.common import segment_mask
from ..ops.full import full_attention
from ..registry import register
from .base import AttentionCall, AttentionMechanism, ContextParallelPlan


@dataclass(frozen=True)
class FullConfig:
    """Ordinary causal attention over the whole prefix."""

    kind: str = field(default="full", init=False)


@register(FullConfig, summary="causal attention over the whole prefix")
class FullAttention(AttentionMechanism):
    """Every query attends to every preceding key (and itself)."""

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        if cache is not None:
            k, v = cache.update(k, v)
        starts = call.segment_starts
        mask = None if starts is None else segment_mask(starts, q.shape[2], k.shape[2])
        return full_attention(q, k, v, call.scale, mask), None

    def context_parallel_plan(self, call: AttentionCall, n: int) -> ContextParallelPlan:
        return ContextParallelPlan(reads=masks.causal)  # the causal ring
