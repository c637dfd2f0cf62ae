"""The hooks ``allhere.train.train`` calls in a torchrun job with more than one process: FSDP2 training
where the ranks form the 2-D mesh of a ``ParallelConfig`` (``allhere.distributed.parallel``), data parallel
x context parallel. Each data-parallel replica takes its share of each step's micro-batches; the cp ranks
of a replica split each of its sequences and run attention through the ring. The parameters are sharded
over all ranks, and FSDP's mean of the gradients over all of them is the one-process gradient of the global
batch (``allhere.distributed.context`` weights each rank's loss so)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from . import sharded_checkpoint as sharded
from .env import DistEnv, detect, init
from .fsdp import shard_model
from .parallel import ParallelConfig


class DistributedRun:
    """The run of ``parallel``'s mesh over the processes of ``env`` (checked: ``ParallelConfig.mesh``), each
    step of ``grad_accum`` micro-batches."""

    def __init__(self, env: DistEnv, device: str, parallel: ParallelConfig, grad_accum: int) -> None:
        self.dp, self.cp = parallel.mesh(env.world, grad_accum)
        self.layout, self.grad_accum = parallel.layout, grad_accum
        self.env = env
        self.device = init(env, device)
        self.cp_group, self.dp_rank = None, env.rank  # one process per replica: no ring
        if self.cp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(torch.device(self.device).type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            self.cp_group, self.dp_rank = mesh.get_group("cp"), mesh.get_local_rank("dp")

    @property
    def main(self) -> bool:
        return self.env.main

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return shard_model(model, self.device)

    def micro_batches(self) -> range:
        """This rank's micro-batch indices of a step: r, r + d, r + 2d, ... for data-parallel replica r of d
        (every cp rank of a replica takes the same ones). Each rank divides its loss by its own count and
        FSDP averages the gradients over ranks, so the step's gradient is the mean over all grad_accum
        micro-batches, as with one process."""
        return range(self.dp_rank, self.grad_accum, self.dp)

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


def distributed_run(device: str, parallel: ParallelConfig, grad_accum: int) -> DistributedRun | None:
    """A ``DistributedRun`` of ``parallel``'s mesh when this process is one of several torchrun workers, else
    None (after checking that one process can run ``parallel``)."""
    env = detect()
    if env is None:
        parallel.mesh(1, grad_accum)
        return None
    return DistributedRun(env, device, parallel, grad_accum)
