"""Run a function on N CPU processes joined by gloo, for the distributed benchmarks (``dar_ring_bytes.py``,
``dar_ring_memory.py``, ``sharded_load.py``): ``launch(fn, world, *args)`` calls ``fn(rank, world, *args)``
on each rank, one thread each, and returns every rank's result (anything ``torch.save`` takes), in rank
order. ``fn`` must be a module-level function (the processes are spawned)."""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launch(fn, world: int, *args) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, port, out, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]


def _entry(rank: int, world: int, port: int, out: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
