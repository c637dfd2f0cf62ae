"""The hooks ``allhere.train.train`` calls in a torchrun job with more than one process: FSDP2 training
where the ranks form a 2-D mesh, data parallel x context parallel (dp x cp = world; row-major, so the cp
ranks of one data-parallel replica are neighbours). Each data-parallel replica takes its share of each
step's micro-batches; the cp ranks of a replica split each of its sequences and run attention through the
ring. The parameters are sharded over all ranks, and FSDP's mean of the gradients over all of them is the
one-process gradient of the global batch (``allhere.distributed.context`` weights each rank's loss so)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..validation import ConfigError
from . import checkpoint as sharded, layouts
from .env import DistEnv, detect, init
from .fsdp import shard_model


class DistributedRun:
    def __init__(self, env: DistEnv, device: str, context_parallel: int = 1) -> None:
        check_mesh(env.world, context_parallel)
        self.env = env
        self.device = init(env, device)
        self.cp, self.dp = context_parallel, env.world // context_parallel
        self.cp_group, self.dp_rank = None, env.rank  # one process per replica: no ring
        if context_parallel > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(torch.device(self.device).type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            self.cp_group, self.dp_rank = mesh.get_group("cp"), mesh.get_local_rank("dp")

    @property
    def main(self) -> bool:
        return self.env.main

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return shard_model(model, self.device)

    def micro_batches(self, grad_accum: int) -> range:
        """This rank's micro-batch indices of a step: r, r + d, r + 2d, ... for data-parallel replica r of d
        (every cp rank of a replica takes the same ones). Each rank divides its loss by its own count and
        FSDP averages the gradients over ranks, so the step's gradient is the mean over all grad_accum
        micro-batches, as with one process."""
        check_mesh(self.env.world, self.cp, grad_accum)
        return range(self.dp_rank, grad_accum, self.dp)

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


def distributed_run(device: str, context_parallel: int = 1) -> DistributedRun | None:
    """A ``DistributedRun`` when this process is one of several torchrun workers, else None. ``context_parallel``:
    the ranks that split each sequence (the rest of the world is data parallel)."""
    env = detect()
    if env is None:
        check_mesh(1, context_parallel)
        return None
    return DistributedRun(env, device, context_parallel)


def check_mesh(world: int, context_parallel: int, grad_accum: int | None = None, layout: str | None = None,
               seq_len: int | None = None) -> None:
    """ConfigError (one line) for a dp x cp mesh a run cannot have: ``context_parallel`` ranks must divide the
    ``world`` processes; the world / cp data-parallel replicas must share a step's ``grad_accum`` micro-batches
    evenly; with cp > 1, a sequence of ``seq_len`` tokens must cut into ``layout``'s chunks. Checked by the
    run itself, and by a caller that wants the error before it loads anything (``allhere.hf.sft``)."""
    if context_parallel < 1 or world % context_parallel:
        raise ConfigError(f"context parallel {context_parallel} needs a multiple of {context_parallel} processes "
                          f"(torchrun --nproc-per-node); this run has {world}")
    dp = world // context_parallel
    if grad_accum is not None and grad_accum % dp:
        what = f"{world} processes / context parallel {context_parallel}" if context_parallel > 1 else "processes"
        raise ConfigError(f"grad_accum (global batch / batch size) = {grad_accum} micro-batches per step cannot be "
                          f"shared evenly by {dp} data-parallel replicas ({what})")
    if context_parallel == 1 or layout is None:
        return
    pieces = context_parallel * layouts.chunks_per_rank(layout)  # a ConfigError for an unknown layout
    if seq_len is not None and seq_len % pieces:
        raise ConfigError(f"seq_len = {seq_len} must be a multiple of {pieces} to be cut into the {layout} layout's "
                          f"chunks over {context_parallel} ranks")
