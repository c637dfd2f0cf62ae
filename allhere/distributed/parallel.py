"""How the processes of a torchrun job share a training run: a 2-D mesh, data parallel x context parallel.

The processes form a row-major (data_parallel, context_parallel) mesh, so the cp ranks of one replica are
neighbours (on one node, when cp divides the GPUs per node). Each data-parallel replica takes its share of a
step's micro-batches; the cp ranks of a replica split each of its sequences (``layout``) and run attention
through the ring (``allhere.distributed.context``). ``allhere.train.train(..., parallel=...)`` builds the
run from it (``allhere.distributed.training``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import ConfigError, check, check_int
from .layouts import LAYOUTS, chunks_per_rank


@dataclass(frozen=True)
class ParallelConfig:
    """The mesh of a distributed training run; checked on construction, and against the run's processes,
    micro-batches and sequence length by ``mesh``."""

    context_parallel: int = 1  # cp: ranks that split each sequence, attention through the ring (1: none)
    layout: str = "zigzag"  # how a sequence is cut over the cp ranks: "zigzag" (balanced causal work) | "contiguous"
    data_parallel: int | None = None  # dp: replicas sharing each step's micro-batches; None: processes / cp

    def __post_init__(self) -> None:
        c = "ParallelConfig"
        check_int(c, "context_parallel", self.context_parallel, 1)
        check(self.layout in LAYOUTS, c, "layout", self.layout, f"one of {LAYOUTS}")
        if self.data_parallel is not None:
            check_int(c, "data_parallel", self.data_parallel, 1)

    def mesh(self, world: int, grad_accum: int | None = None, seq_len: int | None = None) -> tuple[int, int]:
        """(dp, cp) on ``world`` processes; ConfigError (one line) for a mesh the run cannot have: cp must
        divide the processes (dp x cp = world when dp is given); the dp replicas must share a step's
        ``grad_accum`` micro-batches evenly; with cp > 1, a sequence of ``seq_len`` tokens must cut into the
        layout's chunks."""
        cp = self.context_parallel
        if world % cp:
            raise ConfigError(f"context parallel {cp} needs a multiple of {cp} processes (torchrun --nproc-per-node); "
                              f"this run has {world}")
        dp = world // cp
        if self.data_parallel is not None and self.data_parallel != dp:
            raise ConfigError(f"data parallel {self.data_parallel} x context parallel {cp} needs "
                              f"{self.data_parallel * cp} processes; this run has {world}")
        if grad_accum is not None and grad_accum % dp:
            what = f"{world} processes / context parallel {cp}" if cp > 1 else "processes"
            raise ConfigError(f"grad_accum (global batch / batch size) = {grad_accum} micro-batches per step cannot be "
                              f"shared evenly by {dp} data-parallel replicas ({what})")
        pieces = cp * chunks_per_rank(self.layout)
        if cp > 1 and seq_len is not None and seq_len % pieces:
            raise ConfigError(f"seq_len = {seq_len} must be a multiple of {pieces} to be cut into the {self.layout} "
                              f"layout's chunks over {cp} ranks")
        return dp, cp
