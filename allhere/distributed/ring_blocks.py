"""Which blocks the ring computes: a ``Pattern`` is a mask plus the block test the ring asks.

The ring decides per (query chunk, key chunk) whether *any* score of that block is kept. A ``Pattern``
answers with the block test of its mask (``allhere.masks.Mask.tiles``, the one home of a pattern's block
rule): exact for ``masks.causal`` and ``masks.sliding_window`` (so the ring skips exactly the blocks they
never read), a superset for sinks, dilated windows, Longformer and BigBird (it may keep a block with no
kept score, never drop one with some). A mask without a block test (a plain predicate ``(b, h, q_idx,
kv_idx) -> bool`` on absolute positions) is evaluated densely over the block, exact at one bool per score.
``reach`` replaces the mask's test where a caller has a better one (a pattern restricted to segments keeps
the test of the pattern it restricts). ``pattern_from(pred)`` wraps any mask or predicate, so sparse
patterns work without ring code of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import masks
from ..masks import Mask, MaskFn

Reach = Callable[[int, int, int, int], bool]


@dataclass(frozen=True)
class Pattern:
    name: str
    pred: Mask  # a plain predicate is made a ``Mask`` (without block tests) on construction
    reach: Reach | None = None  # "any kept score" for q in [q0, q1), k in [k0, k1), instead of the mask's test
    batch: int = 1  # rows of a batch-dependent predicate (e.g. per-sequence global tokens); 1: it is not
    heads: int = 1  # heads of a head-dependent predicate; 1: it is not

    def __post_init__(self) -> None:
        object.__setattr__(self, "pred", masks.as_mask(self.pred))

    def block_kept(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        if q0 >= q1 or k0 >= k1:
            return False
        if self.reach is not None:
            return bool(self.reach(q0, q1, k0, k1))
        b = torch.arange(self.batch).view(-1, 1)
        h = torch.arange(self.heads).view(1, -1)
        tiles = self.pred.tiles
        if tiles is not None:  # inclusive bounds
            t = lambda x: torch.tensor(x)  # noqa: E731
            return bool(torch.as_tensor(tiles(b, h, t(q0), t(q1 - 1), t(k0), t(k1 - 1))).any())
        return bool(self.mask(torch.arange(q0, q1), torch.arange(k0, k1)).any())

    def kept_map(self, n_chunks: int, chunk: int) -> list[list[bool]] | None:
        """[i][j]: whether block (query chunk i, key chunk j), chunks of ``chunk`` positions from 0, holds a
        kept score, by one evaluation of the mask's block test over every block (what ``block_kept`` says
        block by block); None where the pattern is asked block by block (``reach``, or no block test)."""
        if self.reach is not None or self.pred.tiles is None:
            return None
        lo = torch.arange(n_chunks) * chunk
        hi = lo + chunk - 1
        b = torch.arange(self.batch).view(-1, 1, 1, 1)
        h = torch.arange(self.heads).view(1, -1, 1, 1)
        kept = self.pred.tiles(b, h, lo.view(1, 1, -1, 1), hi.view(1, 1, -1, 1), lo.view(1, 1, 1, -1),
                               hi.view(1, 1, 1, -1))
        kept = torch.as_tensor(kept) | torch.zeros(1, 1, n_chunks, n_chunks, dtype=torch.bool)
        return kept.reshape(-1, n_chunks, n_chunks).any(0).tolist()

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """bool [batch or 1, heads or 1, len(q_pos), len(k_pos)] of the predicate at these positions."""
        dev = q_pos.device
        b = torch.arange(self.batch, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(self.heads, device=dev).view(1, -1, 1, 1)
        m = self.pred(b, h, q_pos.view(1, 1, -1, 1), k_pos.view(1, 1, 1, -1))
        return m.expand(m.shape[0], m.shape[1], len(q_pos), len(k_pos))


def causal() -> Pattern:
    """Every key at or before the query (``allhere.masks.causal``)."""
    return Pattern("causal", masks.causal)


def sliding(window: int) -> Pattern:
    """The ``window`` most recent keys, the query's own included (``allhere.masks.sliding_window``)."""
    return Pattern(f"sliding_{window}", masks.sliding_window(window))


def pattern_from(pred: MaskFn | Mask | Pattern, name: str | None = None, batch: int = 1, heads: int = 1) -> Pattern:
    """A ``Pattern`` of any mask or predicate, or the pattern itself. Give ``batch`` / ``heads`` for a mask
    that depends on the batch row or the head, so that every row and head is tested."""
    if isinstance(pred, Pattern):
        return pred
    mask = masks.as_mask(pred)
    return Pattern(name or mask.name, mask, None, batch, heads)
