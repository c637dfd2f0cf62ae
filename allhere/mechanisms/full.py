"""Mechanism ``full``: ordinary causal attention over the whole prefix."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import masks
from ..ops.common import segment_mask
from ..ops.full import causal_attention, masked_attention
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
        if call.segment_starts is None:
            return causal_attention(q, k, v, scale=call.scale), None
        mask = segment_mask(call.segment_starts, q.shape[2], k.shape[2])
        return masked_attention(q, k, v, mask, call.scale), None

    def context_parallel_plan(self, call: AttentionCall, n: int) -> ContextParallelPlan:
        return ContextParallelPlan(reads=masks.causal)  # the causal ring
