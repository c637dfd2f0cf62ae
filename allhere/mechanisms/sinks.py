"""Mechanism ``sinks``: a sliding window plus attention sinks, as in StreamingLLM ("Efficient Streaming
Language Models with Attention Sinks", arXiv:2309.17453). Each query reads its ``window`` most recent keys
(itself included) and the first ``n_sinks`` tokens of the sequence; the cache keeps exactly those, so
memory stays constant however long generation runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..masks import Mask, sliding_with_sinks
from ..registry import Serving, register
from ..validation import check, check_int
from .caches import PatternKVCache
from .masked_base import PatternAttention


@dataclass(frozen=True)
class SinksConfig:
    """Window + sinks: query i sees keys j with 0 <= i - j < window, and keys j < n_sinks (j <= i)."""

    window: int = 256  # most recent keys each query sees, the current token included
    n_sinks: int = 4  # first tokens every query sees (0: plain sliding window)
    causal: bool = True  # False: an encoder's two-sided window (|i - j| < window), no cache

    kind: str = field(default="sinks", init=False)

    def __post_init__(self) -> None:
        check_int("SinksConfig", "window", self.window, 1)
        check_int("SinksConfig", "n_sinks", self.n_sinks, 0)
        check(isinstance(self.causal, bool), "SinksConfig", "causal", self.causal, "True or False")

    def mask_fn(self, n: int | None = None, layer: int | None = None) -> Mask:
        """The predicate of this pattern (the same for every length and layer)."""
        return sliding_with_sinks(self.window, self.n_sinks, causal=self.causal)


# served (allhere.serve, vLLM's CPU backend): a KV cache group keeping only the sink and window blocks
@register(SinksConfig, summary="window of w keys plus the first n_sinks tokens (StreamingLLM)",
          serving=Serving("sinks", own_cache_group="their cache frees the blocks between the sinks and the window"))
class SinksAttention(PatternAttention):
    """Block-sparse attention under ``sliding_with_sinks``; decodes with a cache of sinks + window."""

    def new_cache(self) -> PatternKVCache:
        """Constant memory: the first ``n_sinks`` keys and the last ``window``."""
        n_sinks = self.cfg.n_sinks
        return PatternKVCache(self.cfg.window, fixed=lambda pos: pos < n_sinks)

    def fast(self, q, k, v, scale):
        if self.cfg.n_sinks == 0 and self.cfg.causal:  # a plain window: the blocked sliding op
            from ..ops.sliding import sliding_window_attention_torch

            return sliding_window_attention_torch(q, k, v, self.cfg.window, scale=scale)
        return None
