"""Forward speed of the sparse patterns' fast paths against dense causal SDPA, on CPU (or any device).

    python benchmarks/patterns_speed.py [--n 8192] [--heads 8] [--kv-heads 2] [--dim 64] [--repeats 3]

Per pattern: density (allowed scores / n^2), the fast path's time (the tile plan built once beforehand,
as a model reuses it across layers and steps; its build time is printed apart), dense causal SDPA's time,
ratio = dense / fast and limit = dense causal scores / pattern scores (what a path doing exactly the
pattern's scores at SDPA's speed would reach). Times are the minimum over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from allhere.masks import bigbird, dilated_window, longformer, sliding_window, sliding_with_sinks
from allhere.ops.blocksparse import blocksparse_attention, plan_blocks
from allhere.ops.dilated import dilated_window_attention
from allhere.ops.sliding import sliding_window_attention


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def scores(plan) -> int:
    """Allowed (query head, key) pairs of a plan, per batch row."""
    lead = plan.batch * plan.kv_heads if not (plan.per_batch or plan.per_head) else (1 if plan.per_batch else plan.batch)
    total = sum(int((b.mask[0] & b.seen).sum()) for b in plan.buckets) * lead
    return total // plan.batch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block", type=int, default=64)
    args = p.parse_args(argv)
    n, h, hkv, d = args.n, args.heads, args.kv_heads, args.dim
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, h, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g)
    dense_scores = n * (n + 1) // 2
    w = 512
    patterns = {  # name: (predicate, fast path or None = the block-sparse plan)
        f"sliding w={w} (blocked op)": (sliding_window(w), lambda: sliding_window_attention(q, k, v, w)),
        f"sliding w={w} (block-sparse)": (sliding_window(w), None),
        f"sinks w={w} s=4": (sliding_with_sinks(w, 4), None),
        f"dilated w={w // 2} d=2": (dilated_window(w // 2, 2), lambda: dilated_window_attention(q, k, v, w // 2, 2)),
        f"dilated w={w // 4} d=(1,2,4,8)x": (dilated_window(w // 4, (1, 2, 4, 8) * (h // 4)),
                                             lambda: dilated_window_attention(q, k, v, w // 4, (1, 2, 4, 8) * (h // 4))),
        f"longformer w={w} g=16": (longformer(w, torch.arange(n) < 16), None),
        "bigbird b=64 w=3 g=1 r=3": (bigbird(64, 3, 1, 3, seed=0, heads_per_draw=h // hkv), None),
    }
    print(f"n={n} heads={h} kv_heads={hkv} dim={d} threads={torch.get_num_threads()} device=cpu")
    print(f"{'pattern':<28} {'density':>8} {'plan s':>7} {'fast s':>8} {'dense s':>8} {'ratio':>6} {'limit':>6}  >= limit/2")
    with torch.no_grad():
        dense = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h), args.repeats)
        for name, (pred, fast) in patterns.items():
            t0 = time.perf_counter()
            plan = plan_blocks(pred, n, n, heads=h, kv_heads=hkv, block=args.block)
            t_plan = time.perf_counter() - t0
            s = scores(plan) / h
            if fast is None:
                fast = lambda plan=plan: blocksparse_attention(q, k, v, plan)  # noqa: E731
            t = best(fast, args.repeats)
            dense_again = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h), 1)
            td = min(dense, dense_again)
            ratio, limit = td / t, dense_scores / s
            print(f"{name:<28} {s / n ** 2:8.3%} {t_plan:7.2f} {t:8.3f} {td:8.3f} {ratio:6.2f} {limit:6.2f}  "
                  f"{'yes' if ratio >= limit / 2 else 'no'}")


if __name__ == "__main__":
    main()
