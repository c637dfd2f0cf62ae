"""Worker processes of the distributed tests (CPU, gloo): started with ``torch.multiprocessing.spawn``,
each writes its results to a file the test reads back."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = dict(b=2, h=4, hkv=2, d=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, world: int, tmp: Path, *args) -> list[dict]:
    """Run ``fn(rank, world, tmp, *args)`` in ``world`` gloo processes (torchrun's environment variables
    set, as torchrun would); return each rank's saved result."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(world, free_port(), fn, tmp, args), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _entry(rank, world, port, fn, tmp, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, tmp, *args)
        torch.save(result, tmp / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def full_inputs(n: int, seed: int = 0):
    """q, k, v, dout, scores of the whole sequence (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, d = SHAPE["b"], SHAPE["h"], SHAPE["hkv"], SHAPE["d"]
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    dout = torch.randn(b, h, n, d, generator=g)
    scores = torch.rand(b, h, n, generator=g)
    return q, k, v, dout, scores


def saved_bytes_hooks(into: dict):
    """saved_tensors_hooks that record the bytes of every storage autograd keeps for the backward."""
    into["storages"] = {}

    def pack(t):
        into["storages"][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    return pack, lambda t: t


def ring_cases(rank, world, tmp, cases):
    """Each case (name, layout, n, kind, arg): run the ring on this rank's shard, backward with the shard
    of a fixed dout; return outputs, gradients and counters."""
    from allhere.distributed import (
        RingStats,
        layouts,
        ring_aha_attention,
        ring_attention,
    )
    from allhere.distributed.ring_blocks import pattern_from, sliding
    from allhere.ops.ste import straight_through

    results = {}
    for name, layout, n, kind, arg in cases:
        q, k, v, dout, scores = full_inputs(n)
        sh = lambda x: layouts.shard(x, layout, world, rank).clone()  # noqa: E731
        q, k, v, dout, scores = (sh(x) for x in (q, k, v, dout, scores))
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        stats = RingStats()
        extra = {}
        hooks = torch.autograd.graph.saved_tensors_hooks(*saved_bytes_hooks(extra))
        hooks.__enter__()
        if kind == "full":
            out = ring_attention(q, k, v, None, layout=layout, stats=stats)
        elif kind == "sliding":
            out = ring_attention(q, k, v, sliding(arg), layout=layout, stats=stats)
        elif kind == "predicate":
            from allhere import masks
            out = ring_attention(q, k, v, pattern_from(getattr(masks, arg[0])(*arg[1:])), layout=layout, stats=stats)
        elif kind == "aha":  # a fixed (bool) gate
            out = ring_aha_attention(q, k, v, scores > arg[1], arg[0], layout=layout, stats=stats)
        elif kind == "aha_ste":  # a trained gate
            s = scores.clone().requires_grad_(True)
            out = ring_aha_attention(q, k, v, straight_through(s, arg[1]), arg[0], layout=layout, stats=stats)
            extra["s"] = s
        else:
            raise ValueError(kind)
        hooks.__exit__(None, None, None)
        (out * dout).sum().backward()
        res = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "stats": stats.counts,
               "saved_bytes": sum(extra["storages"].values())}
        if "s" in extra:
            res["ds"] = extra["s"].grad
        results[name] = res
    return results
