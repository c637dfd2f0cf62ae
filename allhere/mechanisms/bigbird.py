"""Mechanism ``bigbird``: BigBird's block-sparse pattern ("Big Bird: Transformers for Longer Sequences",
arXiv:2007.14062). Positions are cut into blocks of ``block``; query block i reads the key blocks of its
window (the ``window_blocks`` most recent, its own included), the first ``global_blocks`` blocks (which
also read everything), and ``random_blocks`` random key blocks per head.

Randomness: seeded and reproducible, drawn per (seed, layer, head, query block) among the earlier blocks
the window and globals do not cover (``allhere.masks.BigBirdRandom``): a prefix of a sequence has the
pattern of the whole sequence, so cached generation equals the full forward. ``layer`` is a config field
(a mechanism does not know its depth): ``bigbird_schedule`` gives each layer its own draw. The paper draws
per head; with grouped-query attention ``heads_per_draw = n_heads // kv_heads`` draws per kv head instead,
so the block-sparse op gathers each kv head's keys for exactly the pattern (a kv head otherwise serves the
union of its query heads' random blocks: more work for the same result).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..masks import Mask, bigbird
from ..registry import Serving, register
from ..validation import check, check_int
from .caches import KVCache
from .masked_base import PatternAttention


@dataclass(frozen=True)
class BigBirdConfig:
    """Block window OR global blocks OR random blocks, in blocks of ``block`` positions."""

    block: int = 64  # positions per block
    window_blocks: int = 3  # key blocks of the window: query block i sees blocks i - window_blocks + 1 .. i
    global_blocks: int = 1  # the first blocks see every key and are seen by every query
    random_blocks: int = 3  # random key blocks per (head, query block)
    seed: int = 0
    layer: int = 0  # part of the random draw's seed (``bigbird_schedule`` numbers the layers)
    heads_per_draw: int = 1  # consecutive query heads sharing one random draw (n_heads // kv_heads: per kv head)
    causal: bool = True  # False: an encoder (|i - j| < window_blocks, random among every block), no cache

    kind: str = field(default="bigbird", init=False)

    def __post_init__(self) -> None:
        c = "BigBirdConfig"
        check_int(c, "block", self.block, 1)
        check_int(c, "window_blocks", self.window_blocks, 1)
        check_int(c, "global_blocks", self.global_blocks, 0)
        check_int(c, "random_blocks", self.random_blocks, 0)
        check_int(c, "seed", self.seed, 0)
        check_int(c, "layer", self.layer, 0)
        check_int(c, "heads_per_draw", self.heads_per_draw, 1)
        check(isinstance(self.causal, bool), c, "causal", self.causal, "True or False")

    def mask_fn(self, n: int | None = None, layer: int | None = None) -> Mask:
        """The predicate for sequences of length ``n`` (only an encoder's random blocks depend on it) at
        ``layer`` (default: the config's)."""
        return bigbird(self.block, self.window_blocks, self.global_blocks, self.random_blocks, self.seed,
                       self.layer if layer is None else layer, causal=self.causal,
                       length=None if self.causal else n, heads_per_draw=self.heads_per_draw)


def bigbird_schedule(n_layers: int, **fields) -> tuple[BigBirdConfig, ...]:
    """One ``BigBirdConfig`` per layer with ``layer`` = its index: each layer draws its own random blocks."""
    return tuple(BigBirdConfig(layer=i, **fields) for i in range(n_layers))


@register(BigBirdConfig, summary="block window + global blocks + seeded random blocks (BigBird)",
          serving=Serving("masked"))  # served: allhere's attention over vLLM's paged cache (CPU backend)
class BigBirdAttention(PatternAttention):
    """Block-sparse attention under ``allhere.masks.bigbird`` with tiles of one BigBird block (16..128;
    else 64). Cache: every key -- random blocks reach anywhere into the past, so it cannot be bounded."""

    def __init__(self, cfg: BigBirdConfig, dims) -> None:
        super().__init__(cfg, dims)
        self.tile = cfg.block if 16 <= cfg.block <= 128 else 64

    def new_cache(self) -> KVCache:
        return KVCache()
