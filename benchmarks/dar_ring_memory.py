"""Memory kept for the backward pass by one DAR layer ("Dual Dimensionality for Local and Global Attention",
arXiv:2606.18587) under context parallelism (``allhere.distributed.ring_far``), against the plain
full-attention ring (``allhere.distributed.ring_attention``) on the same shape.

A one-layer ``Decoder`` runs its forward pass on each rank's shard under ``context_parallel`` (gloo, CPU
processes, fp32); ``torch.autograd.graph.saved_tensors_hooks`` record every storage autograd keeps for the
backward while the layer's attention mechanism runs (each storage once, parameters excluded): that is the
"attention MiB" per rank. The backward then runs too; "fwd+bwd s" is the second of two forward + backward
passes of the whole one-layer model (one thread per rank, ranks sharing the machine's cores: a rough figure).

    PYTHONPATH=. python benchmarks/dar_ring_memory.py
    PYTHONPATH=. python benchmarks/dar_ring_memory.py --worlds 2 4 --seq 4096 --heads 8 --kv-heads 2 \\
        --head-dim 64 --d-down 64 --window 128

The bytes do not depend on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from gloo_ranks import launch  # benchmarks/gloo_ranks.py

MIB = 2 ** 20


class AttentionSaved:
    """Bytes of the storages autograd saves while the model's attention mechanisms run (each storage once,
    parameters excluded)."""

    def __init__(self, net: torch.nn.Module) -> None:
        from allhere.mechanisms.base import mechanism_layers

        self.params = {p.untyped_storage().data_ptr() for p in net.parameters()}
        self.seen: dict[int, int] = {}
        self.mechs = mechanism_layers(net)
        self.handles, self.inner = [], []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.seen[ptr] = t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        def pre(module, args):
            self.inner.append(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
            self.inner[-1].__enter__()

        def post(module, args, out):
            self.inner.pop().__exit__(None, None, None)

        for m in self.mechs:
            self.handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def layer_saved(mech, n: int, layout: str, heads: int, kv_heads: int, head_dim: int, batch: int = 1,
                vocab: int = 256) -> dict:
    """On this rank (inside an initialised process group): the bytes one layer's attention saves for the
    backward on its shard, and the seconds of its forward + backward."""
    from allhere import Decoder, ModelConfig
    from allhere.distributed.context import context_parallel

    torch.manual_seed(0)
    net = Decoder(ModelConfig(vocab_size=vocab, d_model=heads * head_dim, n_layers=1, n_heads=heads,
                              n_kv_heads=kv_heads, mechanism=mech))
    ids = torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(1))
    with context_parallel(net, layout=layout) as cp:
        shard, pos, _ = cp.shard(ids)
        for _ in range(2):  # the first pass warms up (one-time imports, allocations); the second is measured
            dist.barrier()
            start = time.perf_counter()
            with AttentionSaved(net) as saved:
                out = net(shard, positions=pos)
            out.logits.float().square().mean().backward()
            seconds = time.perf_counter() - start
    return {"bytes": saved.bytes, "seconds": seconds}


def _rank(rank: int, world: int, n: int, layout: str, args) -> dict:
    from allhere.mechanisms import DARConfig, FullConfig

    shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, batch=args.batch)
    return {"dar": layer_saved(DARConfig(window=args.window, d_down=args.d_down), n, layout, **shape),
            "full": layer_saved(FullConfig(), n, layout, **shape)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks of the ring (default 2 4)")
    p.add_argument("--seq", type=int, default=4096, help="tokens of the whole sequence (default 4096)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--d-down", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    args = p.parse_args(argv)
    print(f"# n {args.seq}, batch {args.batch}, heads {args.heads}, kv_heads {args.kv_heads}, head_dim "
          f"{args.head_dim}, d_down {args.d_down}, window {args.window}, fp32, one layer; attention MiB = bytes "
          "autograd saves for the backward inside the attention, per rank\n")
    print("| ranks | layout | DAR MiB, max over ranks | full ring MiB, max | DAR / full | DAR MiB per rank | "
          "fwd+bwd s, DAR / full (max rank) |\n|---|---|---|---|---|---|---|")
    for world in args.worlds:
        for layout in args.layouts:
            res = launch(_rank, world, args.seq, layout, args)
            dar = max(r["dar"]["bytes"] for r in res)
            full = max(r["full"]["bytes"] for r in res)
            per = " / ".join(f"{r['dar']['bytes'] / MIB:.1f}" for r in res)
            secs = (max(r["dar"]["seconds"] for r in res), max(r["full"]["seconds"] for r in res))
            print(f"| {world} | {layout} | {dar / MIB:.1f} | {full / MIB:.1f} | {dar / full:.2f} | {per} | "
                  f"{secs[0]:.2f} / {secs[1]:.2f} |")


if __name__ == "__main__":
    main()
