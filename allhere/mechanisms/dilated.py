"""Mechanism ``dilated``: a dilated sliding window (Longformer, "Longformer: The Long-Document Transformer",
arXiv:2004.05150). Each query reads ``window`` keys at stride ``dilation``: itself and the keys d, 2d, ...,
(window - 1) d positions back, so it reaches (window - 1) d + 1 positions with ``window`` scores. The
dilation may differ per head (a tuple), and per layer (``dilation_schedule``: Longformer grows it with
depth)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..masks import Mask, dilated_window
from ..ops.dilated import dilated_window_attention
from ..registry import Serving, register
from ..validation import check, check_int
from .caches import RollingKVCache
from .masked_base import PatternAttention, check_dilation


@dataclass(frozen=True)
class DilatedConfig:
    """Query i sees keys j with i - j in {0, d, 2d, ..., (window - 1) d} (|i - j| for an encoder)."""

    window: int = 256  # keys each query sees, the current token included
    dilation: int | tuple = 1  # stride between them; or one stride per query head
    causal: bool = True  # False: an encoder's two-sided window, no cache

    kind: str = field(default="dilated", init=False)

    def __post_init__(self) -> None:
        c = "DilatedConfig"
        check_int(c, "window", self.window, 1)
        check_dilation(self)
        check(isinstance(self.causal, bool), c, "causal", self.causal, "True or False")

    @property
    def span(self) -> int:
        """Positions one query reaches: (window - 1) * max dilation + 1."""
        dmax = max(self.dilation) if isinstance(self.dilation, tuple) else self.dilation
        return (self.window - 1) * dmax + 1

    def mask_fn(self, n: int | None = None, layer: int | None = None) -> Mask:
        """The predicate of this pattern (the same for every length and layer)."""
        return dilated_window(self.window, self.dilation, causal=self.causal)


def dilation_schedule(window: int, dilations, causal: bool = True) -> tuple[DilatedConfig, ...]:
    """One ``DilatedConfig`` per layer, e.g. ``ModelConfig(n_layers=4, layer_mechanisms=dilation_schedule(64,
    (1, 2, 4, 8)))``: small dilations low for local detail, large ones high for reach, as Longformer does.
    Each entry of ``dilations`` is an int or a per-head tuple."""
    return tuple(DilatedConfig(window, d, causal) for d in dilations)


@register(DilatedConfig, summary="w keys at stride d (Longformer's dilated window; per-head / per-layer d)",
          serving=Serving("masked"))  # served: allhere's attention over vLLM's paged cache (CPU backend)
class DilatedAttention(PatternAttention):
    """Whole sequences: residue classes + the blocked window op (``allhere.ops.dilated``); otherwise
    (decode, segments) the block-sparse op. Cache: the last (window - 1) * d + 1 keys."""

    def new_cache(self) -> RollingKVCache:
        return RollingKVCache(self.cfg.span)

    def fast(self, q, k, v, scale):
        return dilated_window_attention(q, k, v, self.cfg.window, self.cfg.dilation, self.cfg.causal, scale, self.tile)
