"""Which blocks the ring computes: a ``Pattern`` is a mask predicate plus a block test.

The ring decides per (query chunk, key chunk) whether *any* score of that block is kept. A ``Pattern``
answers, in this order: with ``reach(q0, q1, k0, k1)`` -- exact, O(1), for half-open position ranges --
where the pattern has a closed form (causal, sliding window); with the predicate's own ``tiles`` test
where ``allhere.masks`` gives it one (sinks, dilated windows, Longformer, BigBird: a superset test --
it may keep a block with no kept score, never drop one with some); otherwise by evaluating the
predicate (``(b, h, q_idx, kv_idx) -> bool`` on absolute positions) densely over the block, exact for
any predicate at one bool per score. ``pattern_from(pred)`` wraps any predicate, so sparse patterns
work without ring code of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import masks
from ..masks import MaskFn

Reach = Callable[[int, int, int, int], bool]


@dataclass(frozen=True)
class Pattern:
    name: str
    pred: MaskFn
    reach: Reach | None = None  # exact "any kept score" for q in [q0, q1), k in [k0, k1)
    batch: int = 1  # rows of a batch-dependent predicate (e.g. per-sequence global tokens); 1: it is not
    heads: int = 1  # heads of a head-dependent predicate; 1: it is not

    def block_kept(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        if q0 >= q1 or k0 >= k1:
            return False
        if self.reach is not None:
            return bool(self.reach(q0, q1, k0, k1))
        b = torch.arange(self.batch).view(-1, 1)
        h = torch.arange(self.heads).view(1, -1)
        tiles = getattr(self.pred, "tiles", None)
        if tiles is not None:  # inclusive bounds
            t = lambda x: torch.tensor(x)  # noqa: E731
            return bool(torch.as_tensor(tiles(b, h, t(q0), t(q1 - 1), t(k0), t(k1 - 1))).any())
        return bool(self.mask(torch.arange(q0, q1), torch.arange(k0, k1)).any())

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """bool [batch or 1, heads or 1, len(q_pos), len(k_pos)] of the predicate at these positions."""
        dev = q_pos.device
        b = torch.arange(self.batch, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(self.heads, device=dev).view(1, -1, 1, 1)
        m = self.pred(b, h, q_pos.view(1, 1, -1, 1), k_pos.view(1, 1, 1, -1))
        return m.expand(m.shape[0], m.shape[1], len(q_pos), len(k_pos))


def causal() -> Pattern:
    return Pattern("causal", masks.causal, lambda q0, q1, k0, k1: k0 <= q1 - 1)


def sliding(window: int) -> Pattern:
    """The ``window`` most recent keys, the query's own included (``allhere.masks.sliding_window``)."""
    return Pattern(f"sliding_{window}", masks.sliding_window(window),
                   lambda q0, q1, k0, k1: k0 <= q1 - 1 and q0 - (k1 - 1) < window)


def pattern_from(pred: MaskFn | Pattern, name: str | None = None, batch: int = 1, heads: int = 1) -> Pattern:
    """A ``Pattern`` of any predicate, or the pattern itself. Give ``batch`` / ``heads`` for a predicate
    that depends on the batch row or the head, so that every row and head is tested."""
    if isinstance(pred, Pattern):
        return pred
    return Pattern(name or getattr(pred, "__name__", "predicate"), pred, None, batch, heads)
