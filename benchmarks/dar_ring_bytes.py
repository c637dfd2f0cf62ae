"""Bytes on the ring for one DAR layer ("Dual Dimensionality for Local and Global Attention",
arXiv:2606.18587) against the plain full-attention ring on the same shape: a real gloo run of the forward
pass (``allhere.distributed.ring_far`` against ``allhere.distributed.ring``), counted by ``RingStats``, next
to the closed forms (w <= chunk):

    contiguous: DAR / full = d_down / (2 kv_heads head_dim) + 2 (w - 1) / n
    zigzag:     DAR / full = d_down / (2 kv_heads head_dim) + 8 (w - 1) / (3 n)

(a chunk travels as its latents; the full K/V of the neighbouring chunk's last w - 1 tokens travel too).
The backward pass sends back only the gradients of what arrived: the same bytes as DAR's forward.

    python benchmarks/dar_ring_bytes.py                       # kv_heads 8, head_dim 128, d_down 512, w 256
    python benchmarks/dar_ring_bytes.py --worlds 4 --seq 4096 --d-down 256

Bytes do not depend on the machine; the ranks are CPU processes (bf16 tensors, random weights).
"""

from __future__ import annotations

import argparse

import torch
from gloo_ranks import launch  # benchmarks/gloo_ranks.py

MIB = 2 ** 20


def _rank(rank: int, world: int, n: int, layout: str, args) -> dict:
    from allhere import masks
    from allhere.distributed import RingStats, ring_attention
    from allhere.distributed.ring_far import ring_far_attention
    from allhere.mechanisms.base import ContextParallelPlan, FarKV

    g, dt, m = torch.Generator().manual_seed(rank), torch.bfloat16, n // world
    kv, hd = args.kv_heads, args.head_dim
    q = torch.randn(1, kv, m, hd, generator=g).to(dt)  # query heads do not change the bytes
    k, v = (torch.randn(1, kv, m, hd, generator=g).to(dt) for _ in range(2))
    latents = torch.randn(1, m, args.d_down, generator=g).to(dt)
    w_k, w_v = ((torch.randn(kv * hd, args.d_down, generator=g) / args.d_down ** 0.5).to(dt) for _ in range(2))

    def expand(c, positions):  # K/V of the latents (W_up absorbed into W_K, W_V; no RoPE: bytes only)
        return tuple((c @ w.T).view(1, -1, kv, hd).transpose(1, 2) for w in (w_k, w_v))

    plan = ContextParallelPlan(reads=masks.causal, far=FarKV(latents, expand, masks.sliding_window(args.window)))
    dar, full = RingStats(), RingStats()
    with torch.no_grad():
        ring_far_attention(q, k, v, plan, layout=layout, stats=dar)
        ring_attention(q, k, v, None, layout=layout, stats=full)
    return {"dar": dar.counts["forward"], "full": full.counts["forward"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8], help="ranks of the ring (default 4 8)")
    p.add_argument("--seq", type=int, nargs="+", default=None,
                   help="sequence length per world, in the same order (default 1024 tokens per rank)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--d-down", type=int, default=512)
    p.add_argument("--window", type=int, default=256)
    args = p.parse_args(argv)
    seqs = args.seq or [1024 * w for w in args.worlds]
    print(f"# kv_heads {args.kv_heads}, head_dim {args.head_dim}, d_down {args.d_down}, window {args.window}, bf16, "
          "one layer, forward\n")
    print("| ranks | n | layout | sent, all ranks: DAR MiB | full MiB | ratio | closed form | busiest rank received: "
          "DAR MiB | full MiB | transfers DAR / full |\n|---|---|---|---|---|---|---|---|---|---|")
    base = args.d_down / (2 * args.kv_heads * args.head_dim)
    for world, n in zip(args.worlds, seqs):
        for layout, extra in (("contiguous", 2 / n), ("zigzag", 8 / (3 * n))):
            res = launch(_rank, world, n, layout, args)
            sent = {m: sum(r[m]["bytes_sent"] for r in res) for m in ("dar", "full")}
            got = {m: max(r[m]["bytes_received"] for r in res) for m in ("dar", "full")}
            moves = {m: max(r[m]["transfers"] for r in res) for m in ("dar", "full")}
            print(f"| {world} | {n} | {layout} | {sent['dar'] / MIB:.2f} | {sent['full'] / MIB:.2f} | "
                  f"{sent['dar'] / sent['full']:.4f} | {base + extra * (args.window - 1):.4f} | "
                  f"{got['dar'] / MIB:.2f} | {got['full'] / MIB:.2f} | {moves['dar']} / {moves['full']} |")
    print(f"\nat n = 131072 the closed forms give {base + 2 * (args.window - 1) / 131072:.4f} (contiguous) and "
          f"{base + 8 * (args.window - 1) / (3 * 131072):.4f} (zigzag)")


if __name__ == "__main__":
    main()
