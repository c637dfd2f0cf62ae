"""``PagedStepPlan``: one served step's batch as the engine scheduled it (its query ranges, lengths and block
table), and what follows from that batch alone, made once for the step and handed to every layer's op.

An engine hands every layer of a KV cache group the same tables for a step, so what follows from them (the block
coordinates of the slot mapping, token positions, each token's row of a block table, rotary factors at those
positions, what a decode step gathers) is the same at every layer: the step's first layer that needs a part makes
it, and the others read it. vLLM's attention metadata builders and FlashInfer's ``plan()`` / ``run()`` split a
step's work the same way. It matters at batch 1, where a step's cost is its number of tensor operations, thirty
layers over. A plan belongs to one step: the next step has a new one, and nothing outlives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


def slot_places(slots: torch.Tensor, block_size: int):
    """Where ``slots`` [tokens] (negative: padding) lie in blocks of ``block_size``: (the index of the kept tokens,
    None when all are kept; their block; their row in it)."""
    keep = slots >= 0
    kept = None if bool(keep.all()) else keep.nonzero().squeeze(1)
    s = (slots if kept is None else slots[kept]).long()
    return kept, s // block_size, s % block_size


def token_positions(query_start: torch.Tensor, seq_lens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request [n], position [n]) of each of the step's first ``n`` query tokens: request r's queries are the
    last ``query_start[r + 1] - query_start[r]`` of its ``seq_lens[r]`` tokens."""
    starts, lens = query_start.long(), seq_lens.long()
    q_len = starts[1:] - starts[:-1]
    req = torch.repeat_interleave(torch.arange(q_len.numel(), device=starts.device), q_len, output_size=n)
    return req, torch.arange(n, device=starts.device) - starts[req] + (lens - q_len)[req]


@dataclass(eq=False)
class PagedStepPlan:
    """The tables of one step of a KV cache group and the parts made from them (``parts``: by what each is and
    what it depends on besides the step, such as a block size or a window)."""

    query_start_loc: torch.Tensor  # [requests + 1]: request r's queries are rows query_start_loc[r] .. [r + 1] - 1
    seq_lens: torch.Tensor  # [requests]: its tokens once this step's are written
    block_table: torch.Tensor  # [requests, >=]: its blocks of the cache, in order
    tokens: int  # the step's tokens (rows of q past them: padding)
    parts: dict = field(default_factory=dict, repr=False)

    def part(self, key: Hashable, make: Callable[[], T]) -> T:
        """The step's part ``key``: ``make()`` at the first layer that asks, kept for the others."""
        if key not in self.parts:
            self.parts[key] = make()
        return self.parts[key]

    def slot_places(self, slots: torch.Tensor, block_size: int):
        """``slot_places`` of the step's slot mapping ``slots`` [tokens] in blocks of ``block_size``:
        where every layer writes the step's keys."""
        return self.part(("slot places", block_size), lambda: slot_places(slots, block_size))

    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(request [tokens], position [tokens]) of the step's tokens (``token_positions``)."""
        return self.part("token positions", lambda: token_positions(self.query_start_loc, self.seq_lens,
                                                                    self.tokens))

    def decodes_only(self) -> bool:
        """Whether every request has at most one query this step."""
        starts = self.query_start_loc
        return self.part("decodes only", lambda: bool((starts[1:] - starts[:-1] <= 1).all()))


def part_of(plan: PagedStepPlan | None, key: Hashable, make: Callable[[], T]) -> T:
    """``plan.part(key, make)``, or ``make()`` for a call outside a planned step (``plan`` None)."""
    return make() if plan is None else plan.part(key, make)
