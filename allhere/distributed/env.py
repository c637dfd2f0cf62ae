"""The distributed environment, read from what torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). One process -- no torchrun, or torchrun with one worker -- is not distributed: nothing
changes for it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes reports and files and shows progress."""
        return self.rank == 0


def detect() -> DistEnv | None:
    """The environment of a process started by torchrun (or anything setting its variables) with more
    than one worker; None otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = os.environ.get("TORCHELASTIC_RUN_ID") is not None or "RANK" in os.environ
    if world <= 1 or not launched:
        return None
    return DistEnv(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def init(env: DistEnv, device: str) -> str:
    """Join the process group (on CUDA: NCCL for CUDA tensors and gloo for CPU ones, such as logged values;
    on CPU: gloo) unless already joined; return this rank's device ("cuda" becomes "cuda:<LOCAL_RANK>")."""
    import torch.distributed as dist

    if device.startswith("cuda"):
        device = f"cuda:{env.local_rank}" if device == "cuda" else device
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
    if dist.get_world_size() != env.world:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, WORLD_SIZE says {env.world}")
    return device
