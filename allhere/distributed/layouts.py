"""How a sequence is split across the ranks of a context-parallel group.

The sequence of n tokens is cut into equal chunks; each rank holds some of them, in sequence order:

  - ``contiguous``: d chunks, rank r holds chunk r. Under a causal mask rank d-1 reads every block and
    rank 0 only its own: the work is unbalanced.
  - ``zigzag``: 2d chunks, rank r holds chunks r and 2d-1-r (one early, one late), so every rank has
    the same causal work (the load-balanced layout used with "Ring Attention with Blockwise Transformers
    for Near-Infinite Context", arXiv:2310.01889, in Striped/zigzag variants).

Everything below is a pure function of (n, layout, world, rank): every rank computes every other
rank's positions itself, without communication.
"""

from __future__ import annotations

import torch

from ..validation import ConfigError

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 1 if layout == "contiguous" else 2


def rank_chunks(layout: str, world: int, rank: int) -> list[int]:
    """Sequence-order ids of the chunks rank ``rank`` holds, in the order they sit in its shard."""
    check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def chunk_len(n: int, layout: str, world: int) -> int:
    parts = world * chunks_per_rank(layout)
    if n % parts:
        raise ValueError(f"sequence length {n} must be a multiple of {parts} ({world} ranks, layout {layout!r})")
    return n // parts


def positions(n: int, layout: str, world: int, rank: int, device=None) -> torch.Tensor:
    """int64 [n / world]: the absolute positions of the tokens rank ``rank`` holds, in shard order."""
    c = chunk_len(n, layout, world)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in rank_chunks(layout, world, rank)])


def shard(x: torch.Tensor, layout: str, world: int, rank: int, dim: int = 2) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (sequence along ``dim``)."""
    c = chunk_len(x.shape[dim], layout, world)
    return torch.cat([x.narrow(dim, i * c, c) for i in rank_chunks(layout, world, rank)], dim=dim)


def unshard(shards: list[torch.Tensor], layout: str, dim: int = 2) -> torch.Tensor:
    """The full-sequence tensor of every rank's shard (``shards[r]`` from rank r), in sequence order."""
    world = len(shards)
    cpr = chunks_per_rank(layout)
    c = shards[0].shape[dim] // cpr
    pieces: dict[int, torch.Tensor] = {}
    for r, s in enumerate(shards):
        for j, i in enumerate(rank_chunks(layout, world, r)):
            pieces[i] = s.narrow(dim, j * c, c)
    return torch.cat([pieces[i] for i in range(world * cpr)], dim=dim)
