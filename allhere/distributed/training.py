"""The hooks ``allhere.train.train`` calls in a torchrun job with more than one process: data-parallel
FSDP2 training where every rank takes its share of each step's micro-batches, so the global batch --
and the gradient -- is the one process's."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint as sharded
from .env import DistEnv, detect, init
from .fsdp import shard_model


class DistributedRun:
    def __init__(self, env: DistEnv, device: str) -> None:
        self.env = env
        self.device = init(env, device)

    @property
    def main(self) -> bool:
        return self.env.main

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return shard_model(model, self.device)

    def micro_batches(self, grad_accum: int) -> range:
        """This rank's micro-batch indices of a step: r, r + d, r + 2d, ... Each rank divides its loss by
        its own count and FSDP averages the gradients over ranks, so the step's gradient is the mean over
        all grad_accum micro-batches, as with one process."""
        if grad_accum % self.env.world:
            raise ValueError(f"grad_accum = {grad_accum} micro-batches per step cannot be shared evenly by "
                             f"{self.env.world} processes: choose a global batch / batch size whose quotient "
                             f"is a multiple of {self.env.world}")
        return range(self.env.rank, grad_accum, self.env.world)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """The logged per-step sums over every rank's micro-batches."""
        t = torch.tensor(list(values.values()), dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(values, t.tolist()))

    def agree(self, signum: int | None) -> int | None:
        """The stop signal any rank received (the largest number), the same on every rank, or None: every
        rank then stops after the same step. One tiny all-reduce per step. torchrun forwards a SIGINT or
        SIGTERM it gets to every worker, then kills those still running after ``--shutdown-timeout`` (30 s
        by default): the step in flight and the checkpoint must fit in it."""
        t = torch.tensor([signum or 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None

    def has_checkpoint(self, ckpt_path: Path) -> bool:
        return Path(ckpt_path).exists() or sharded.dcp_dir(ckpt_path).exists()

    def saved_state(self, ckpt_path: Path) -> dict | None:
        return sharded.latest(ckpt_path)

    def restore(self, ckpt_path: Path, model, optimizer) -> dict:
        return sharded.load(ckpt_path, model, optimizer, self.env)

    def save(self, ckpt_path: Path, model, optimizer, state: dict) -> None:
        sharded.save(ckpt_path, model, optimizer, state, self.env)

    def export(self, ckpt_path: Path, model, state: dict) -> None:
        sharded.export(ckpt_path, model, state, self.env)


def distributed_run(device: str) -> DistributedRun | None:
    """A ``DistributedRun`` when this process is one of several torchrun workers, else None."""
    env = detect()
    return None if env is None else DistributedRun(env, device)
