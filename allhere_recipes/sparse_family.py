"""The sparse attention family compared by ``allhere patterns``, built from the predicates of
``allhere.masks``: each pattern as coloured components (window, global, sink, random) per layer.

Patterns (``causal=False``: the encoder version, windows on both sides):

  - full: dense causal (or dense bidirectional) attention;
  - sliding: the window of ``w`` keys, the current one included;
  - sinks: the window OR the first ``sinks`` keys ("Efficient Streaming Language Models with Attention
    Sinks", arXiv:2309.17453);
  - dilated: ``w`` keys at stride d, d taken per layer from a schedule such as 1, 2, 4, 8
    ("Longformer: The Long-Document Transformer", arXiv:2004.05150, grows d with depth); the KV cache and the
    timing take every layer of the schedule;
  - longformer: the window OR ``g`` global tokens placed first, as Longformer's task tokens (arXiv:2004.05150);
  - longformer-spread: the same number of global tokens spread evenly (one at the end of every n / g
    positions): what global tokens need to be in a decoder to shorten paths;
  - bigbird: BigBird's block-sparse pattern, window blocks OR global blocks OR random blocks ("Big Bird:
    Transformers for Longer Sequences", arXiv:2007.14062), in blocks of ``block`` positions: round(w / block)
    window blocks (the encoder's |i - j| < 2 is BigBird's 3-block window), ceil(g / block) global blocks,
    r random blocks per query block, drawn per layer and head.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from allhere import masks
from allhere.validation import ConfigError, check, check_int

NAMES = ("full", "sliding", "sinks", "dilated", "longformer", "longformer-spread", "bigbird")
KINDS = ("dense", "window", "global", "sink", "random")  # edge colours of the figure, in drawing order
KV_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
MAX_N = 8192  # the graph analysis keeps n x n matrices


@dataclass(frozen=True)
class PatternSettings:
    """Sizes of the family: ``n`` tokens for the graph figures, window ``window`` (the current token
    included), dilation schedule ``dilations`` (layer l uses ``dilations[l % len]``), ``n_global`` global
    tokens, ``sinks`` sink tokens, BigBird ``block`` and ``random_blocks``, ``layers`` for the receptive
    field, ``heads`` (BigBird draws random blocks per head; also the KV-cache and timing heads) and
    ``seed`` of the random blocks."""

    n: int = 2048
    window: int = 128
    dilations: tuple = (1, 2, 4, 8)
    n_global: int = 64
    sinks: int = 4
    random_blocks: int = 3
    block: int = 64
    layers: int = 4
    heads: int = 8
    seed: int = 0

    def __post_init__(self):
        d = self.dilations
        object.__setattr__(self, "dilations",
                           (d,) if isinstance(d, int) else tuple(d) if isinstance(d, (list, tuple)) else d)
        validate(self)

    @property
    def window_blocks(self) -> int:
        return max(1, round(self.window / self.block))

    @property
    def global_blocks(self) -> int:
        return math.ceil(self.n_global / self.block)


def validate(s: PatternSettings) -> None:
    """ConfigError naming the first bad setting."""
    for name, minimum in (("n", 2), ("window", 1), ("n_global", 0), ("sinks", 0), ("random_blocks", 0),
                          ("block", 1), ("layers", 1), ("heads", 1), ("seed", 0)):
        check_int("patterns", name, getattr(s, name), minimum)
    check(s.n <= MAX_N, "patterns", "n", s.n, f"at most {MAX_N} (the graph analysis keeps n x n matrices)")
    check(s.window <= s.n, "patterns", "window", s.window, f"at most n = {s.n}")
    check(isinstance(s.dilations, tuple) and bool(s.dilations)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in s.dilations),
          "patterns", "dilations", s.dilations, "a non-empty list of integers >= 1")
    check(s.n_global <= s.n, "patterns", "n_global", s.n_global, f"at most n = {s.n}")
    check(s.sinks <= s.n, "patterns", "sinks", s.sinks, f"at most n = {s.n}")
    check(s.block <= s.n, "patterns", "block", s.block, f"at most n = {s.n}")


def figure_settings(s: PatternSettings) -> PatternSettings:
    """The same family at n = 64 for the picture: w = 8, 4 global tokens, 2 sinks, blocks of 4, at most 2
    random blocks (none of a kind where ``s`` has none)."""
    return dataclasses.replace(s, n=64, window=8, n_global=4 if s.n_global else 0, sinks=2 if s.sinks else 0, block=4,
                               random_blocks=min(s.random_blocks, 2))


def global_positions(s: PatternSettings, length: int, spread: bool) -> torch.Tensor:
    """bool [length]: the first ``n_global`` positions, or (``spread``) the last position of every
    ``n // n_global`` (the same spacing at every length, so the pattern of a prefix is the prefix's)."""
    flags = torch.zeros(length, dtype=torch.bool)
    if s.n_global == 0:
        return flags
    if spread:
        gap = max(1, s.n // s.n_global)
        flags[gap - 1::gap] = True
    else:
        flags[:s.n_global] = True
    return flags


@dataclass
class Pattern:
    """One pattern: ``layer(l)`` -> [(kind, predicate)] components (OR-ed: the mask); ``period`` layers
    repeat (the dilation schedule, BigBird's per-layer random blocks); ``per_head``: the mask differs
    between heads; ``kv_keys(T, l)``: keys a layer must keep in its cache at generation length T (None:
    not bounded below T)."""

    name: str
    title: str
    layer: Callable[[int], list]
    period: int = 1
    per_head: bool = False
    kv_keys: Callable[[int, int], int] | None = None
    kv_note: str = ""
    whole: Callable[[int], Callable] | None = None  # the pattern as one predicate of allhere.masks, per layer

    def mask_fn(self, layer: int):
        """The OR of the components of ``layer``."""
        parts = [p for _, p in self.layer(layer)]
        return parts[0] if len(parts) == 1 else masks.or_masks(*parts)


def _all(causal: bool):
    if causal:
        return masks.causal
    return lambda b, h, q, k: (q >= 0) & (k >= 0)


def build(s: PatternSettings, causal: bool, length: int, names=NAMES) -> list[Pattern]:
    """The patterns ``names`` of ``s`` (``causal`` or encoder) for sequences of up to ``length`` tokens
    (the encoder's BigBird draws depend on the length; the causal patterns do not)."""
    w, g, r, b = s.window, s.n_global, s.random_blocks, s.block
    wb, gb, dil = s.window_blocks, s.global_blocks, s.dilations
    kv_length = 2 * length  # global flags far enough for the cache check (queries up to 2 length)
    start, spread = global_positions(s, kv_length, False), global_positions(s, kv_length, True)
    out = {
        "full": Pattern("full", "full causal" if causal else "full (encoder)", lambda l: [("dense", _all(causal))],
                        kv_keys=lambda t, l: t, kv_note="every key"),
        "sliding": Pattern("sliding", f"sliding w={w}", lambda l: [("window", masks.sliding_window(w, causal))],
                           kv_keys=lambda t, l: min(t, w), kv_note="the window"),
        "sinks": Pattern("sinks", f"sliding w={w} + {s.sinks} sinks",
                         lambda l: [("window", masks.sliding_window(w, causal)),
                                    ("sink", masks.sinks(s.sinks, causal))],
                         kv_keys=lambda t, l: min(t, w + s.sinks), kv_note="sinks + window",
                         whole=lambda l: masks.sliding_with_sinks(w, s.sinks, causal)),
        "dilated": Pattern("dilated", f"dilated w={w}, d={','.join(map(str, dil))} by layer",
                           lambda l: [("window", masks.dilated_window(w, dil[l % len(dil)], causal))], period=len(dil),
                           kv_keys=lambda t, l: min(t, (w - 1) * dil[l % len(dil)] + 1),
                           kv_note="(w-1) d + 1 per layer"),
        "longformer": Pattern("longformer", f"Longformer w={w}, {g} global first",
                              lambda l: [("window", masks.sliding_window(w, causal)),
                                         ("global", masks.global_tokens(start, causal))],
                              kv_keys=lambda t, l: min(t, w + g), kv_note="window + globals",
                              whole=lambda l: masks.longformer(w, start, 1, causal)),
        "longformer-spread": Pattern("longformer-spread", f"Longformer w={w}, {g} global spread",
                                     lambda l: [("window", masks.sliding_window(w, causal)),
                                                ("global", masks.global_tokens(spread, causal))],
                                     kv_keys=None, kv_note="every key: a later global query reads them all",
                                     whole=lambda l: masks.longformer(w, spread, 1, causal)),
        "bigbird": Pattern("bigbird", f"BigBird b={b}: {wb} win, {gb} glob, {r} rand blocks",
                           lambda l: [("window", masks.bigbird_window(b, wb, causal)),
                                      ("global", masks.bigbird_global(b, gb, causal)),
                                      ("random", masks.bigbird_random(b, wb, gb, r, s.seed, l, causal, length))],
                           period=s.layers, per_head=r > 0, kv_keys=None,
                           kv_note="every key: random blocks range over the whole past",
                           whole=lambda l: masks.bigbird(b, wb, gb, r, s.seed, l, causal, length)),
    }
    unknown = [n for n in names if n not in out]
    if unknown:
        raise ConfigError(f"patterns: unknown pattern {unknown[0]!r}; expected some of {', '.join(NAMES)}")
    return [out[n] for n in names]


def layer_masks(p: Pattern, n: int, layer: int, heads: int, by_kind: bool = False):
    """bool [heads, n, n] mask of ``layer`` (heads = 1 unless the pattern differs per head); with
    ``by_kind`` a dict kind -> mask of that component alone instead."""
    h = heads if p.per_head else 1
    parts = p.layer(layer)
    if by_kind:
        return {kind: masks.dense_mask(pred, n, n, heads=h)[0] for kind, pred in parts}
    return masks.dense_mask(p.mask_fn(layer), n, n, heads=h)[0]
