"""Mechanism ``longformer``: Longformer's pattern ("Longformer: The Long-Document Transformer",
arXiv:2004.05150): a (dilated) sliding window plus global tokens. A global token sees every key and is
seen by every query (with ``causal``: keys at or before the query only).

Global tokens are given by position: the first ``global_first`` tokens and/or ``global_positions``. By
token id (a separator, a question mark) they are not offered here: a mechanism sees q, k, v and the block
input, never the input ids (``allhere.masks.global_from_ids`` builds the flags for code that has them,
e.g. for ``allhere.masks.longformer``).

The paper gives global attention its own q/k/v projections. This mechanism does not: it lives in a host
layer whose projections are shared by every mechanism (and by pretrained Hugging Face models, where such
copies would be new weights of every layer); global tokens use the host's projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..masks import Mask, global_at, global_first, longformer
from ..registry import Serving, register
from ..validation import check, check_int
from .caches import PatternKVCache
from .masked_base import PatternAttention, check_dilation


@dataclass(frozen=True)
class LongformerConfig:
    """(Dilated) window OR global tokens: query i sees keys j with i - j in {0, d, ..., (window - 1) d},
    every global key j <= i, and every key j <= i when i is global (two-sided for an encoder)."""

    window: int = 256  # keys of the window, the current token included
    dilation: int | tuple = 1  # stride of the window; or one stride per query head
    global_first: int = 0  # the first g tokens are global
    global_positions: tuple = ()  # further global positions (absolute, from 0)
    causal: bool = True  # False: an encoder (two-sided window, globals see later keys), no cache

    kind: str = field(default="longformer", init=False)

    def __post_init__(self) -> None:
        c = "LongformerConfig"
        check_int(c, "window", self.window, 1)
        check_dilation(self)
        check_int(c, "global_first", self.global_first, 0)
        check(isinstance(self.global_positions, (list, tuple)) and all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in self.global_positions), c,
            "global_positions", self.global_positions, "a tuple of integer positions >= 0")
        object.__setattr__(self, "global_positions", tuple(sorted(set(self.global_positions))))
        check(isinstance(self.causal, bool), c, "causal", self.causal, "True or False")

    @property
    def span(self) -> int:
        dmax = max(self.dilation) if isinstance(self.dilation, tuple) else self.dilation
        return (self.window - 1) * dmax + 1

    @property
    def last_global(self) -> int:
        """The last global position (-1: none): until it has passed, every key may still be read."""
        return max([self.global_first - 1, *self.global_positions])

    def is_global(self, n: int | None = None) -> torch.Tensor:
        """bool [n] (default: up to the last global position): which positions are global."""
        n = self.last_global + 1 if n is None else n
        return global_first(n, self.global_first) | global_at(n, self.global_positions)

    def mask_fn(self, n: int | None = None, layer: int | None = None) -> Mask:
        """The predicate of this pattern (the same for every length and layer)."""
        return longformer(self.window, self.is_global(max(1, self.last_global + 1)), self.dilation, causal=self.causal)


@register(LongformerConfig, summary="dilated window plus global tokens (first g / positions; Longformer)",
          serving=Serving("masked"))  # served: allhere's attention over vLLM's paged cache (CPU backend)
class LongformerAttention(PatternAttention):
    """Block-sparse attention under ``allhere.masks.longformer``. Cache: the window's span plus the global
    keys seen so far, and every key until the last global query has passed (a global query reads the whole
    past): bounded by span + number of global tokens after that."""

    def new_cache(self) -> PatternKVCache:
        flags = self.cfg.is_global(max(1, self.cfg.last_global + 1))

        def fixed(pos):
            f = flags.to(pos.device)
            return f[pos.clamp(max=f.numel() - 1)] & (pos < f.numel())

        return PatternKVCache(self.cfg.span, fixed=fixed, keep_all_until=self.cfg.last_global)
