"""Forward speed of the sparse patterns' fast paths against dense causal SDPA, on CPU or CUDA.

    python benchmarks/patterns_speed.py [--n 8192] [--heads 8] [--kv-heads 2] [--dim 64] [--repeats 3]
                                        [--device cpu|cuda] [--backend blocksparse|flex]

Per pattern: density (allowed scores / n^2), the fast path's time in milliseconds (its block structure built once
beforehand, as a model reuses it across layers and steps: the tile plan of the block-sparse op, or
FlexAttention's BlockMask with ``--backend flex``; the build time is printed apart, and FlexAttention's
compilation happens in an untimed warm-up call), dense causal SDPA's time, ratio = dense / fast and limit =
dense causal scores / pattern scores (what a path doing exactly the pattern's scores at SDPA's speed would
reach). Times are the minimum over ``--repeats`` runs.

On CUDA the tensors are bf16, times come from CUDA events, and the dense time is that of the fastest SDPA
backend that takes the call (cuDNN, flash, memory-efficient; each with grouped-query K/V as they are and
with K/V expanded to every head beforehand): every ratio is against the fastest dense attention. A
pattern that fails (e.g. out of memory: FlexAttention's ``create_block_mask`` evaluates the predicate on
the whole n x n grid of every head) gets a row saying why, the others still run, and the exit status is 1.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from allhere.masks import (
    bigbird,
    dilated_window,
    longformer,
    sliding_window,
    sliding_with_sinks,
)
from allhere.ops.blocksparse import blocksparse_attention, plan_blocks
from allhere.ops.common import repeat_kv
from allhere.ops.dilated import dilated_window_attention
from allhere.ops.sliding import sliding_window_attention
from allhere_recipes.timing import best_time, timed_call

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def scores(plan) -> int:
    """Allowed (query head, key) pairs of a plan, per batch row."""
    lead = (plan.batch * plan.kv_heads if not (plan.per_batch or plan.per_head)
            else (1 if plan.per_batch else plan.batch))
    total = sum(int((b.mask[0] & b.seen).sum()) for b in plan.buckets) * lead
    return total // plan.batch


def fastest_dense(q, k, v, repeats: int):
    """(name, call) of the fastest dense causal SDPA on CUDA: every backend, with grouped K/V as given
    (``enable_gqa``) and with K/V expanded to every query head beforehand; those refusing the call are
    left out."""
    h, hkv = q.shape[1], k.shape[1]
    layouts = {"gqa": (k, v)} if h == hkv else {"gqa": (k, v), "expanded": (repeat_kv(k, h), repeat_kv(v, h))}
    found = None
    for name, backend in SDPA_BACKENDS.items():
        for layout, (kk, vv) in layouts.items():
            def call(backend=backend, kk=kk, vv=vv):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=kk.shape[1] != h)
            try:
                t = best_time(call, repeats, device="cuda")
            except RuntimeError:  # this backend does not take this shape / dtype / layout
                continue
            if found is None or t < found[0]:
                found = (t, f"{name} ({layout})", call)
    if found is None:
        raise RuntimeError("no SDPA backend takes the dense call")
    return found[1], found[2]


def flex_path(pred, q, k, v):
    """The FlexAttention path as ``PatternAttention`` runs it: (BlockMask build seconds, call). The mask is
    built twice and the second build timed (the first may compile the builder on CUDA)."""
    from allhere.ops.flex import flex_block_mask, flex_pattern_attention

    def build():
        return flex_block_mask(pred, q.shape[2], k.shape[2], heads=q.shape[1], device=q.device, per_batch=False,
                               per_head=pred.per_head)

    build()
    mask, seconds = timed_call(build, q.device.type)
    return seconds, lambda: flex_pattern_attention(q, k, v, mask)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda: bf16, the fastest dense SDPA backend)")
    p.add_argument("--backend", choices=("blocksparse", "flex"), default="blocksparse",
                   help="the block-sparse op (and the blocked window ops) or FlexAttention (compiled)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    n, h, hkv, d, dev = args.n, args.heads, args.kv_heads, args.dim, torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, x, n, d, generator=g).to(dev, dtype) for x in (h, hkv, hkv))
    dense_scores = n * (n + 1) // 2
    w = 512
    blocked = args.backend == "blocksparse"
    patterns = {}  # name: (predicate, a dedicated op or None = the backend's generic path)
    if blocked:
        patterns[f"sliding w={w} (blocked op)"] = (sliding_window(w), lambda: sliding_window_attention(q, k, v, w))
    dils = (1, 2, 4, 8) * (h // 4)
    patterns |= {
        f"sliding w={w}" + (" (block-sparse)" if blocked else ""): (sliding_window(w), None),
        f"sinks w={w} s=4": (sliding_with_sinks(w, 4), None),
        f"dilated w={w // 2} d=2": (dilated_window(w // 2, 2),
                                    (lambda: dilated_window_attention(q, k, v, w // 2, 2)) if blocked else None),
        f"dilated w={w // 4} d=(1,2,4,8)x": (dilated_window(w // 4, dils),
                                             (lambda: dilated_window_attention(q, k, v, w // 4, dils))
                                             if blocked else None),
        f"longformer w={w} g=16": (longformer(w, torch.arange(n) < 16), None),
        "bigbird b=64 w=3 g=1 r=3": (bigbird(64, 3, 1, 3, seed=0, heads_per_draw=h // hkv), None),
    }
    if cuda:
        dense_name, dense_call = fastest_dense(q, k, v, args.repeats)
        print(f"n={n} heads={h} kv_heads={hkv} dim={d} device={torch.cuda.get_device_name(dev)} dtype=bf16 "
              f"backend={args.backend} dense=fastest SDPA: {dense_name}")
    else:
        def dense_call():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
        print(f"n={n} heads={h} kv_heads={hkv} dim={d} threads={torch.get_num_threads()} device=cpu"
              + ("" if blocked else f" backend={args.backend}"))
    print(f"{'pattern':<28} {'density':>8} {'plan ms':>9} {'fast ms':>9} {'dense ms':>9} "
          f"{'ratio':>6} {'limit':>6}  >= limit/2")
    failed = 0
    with torch.no_grad():
        dense = best_time(dense_call, args.repeats, device=args.device)
        for name, (pred, fast) in patterns.items():
            plan, t_plan = timed_call(lambda: plan_blocks(pred, n, n, heads=h, kv_heads=hkv, block=args.block,
                                                          device=dev), args.device)
            s = scores(plan) / h
            try:
                if fast is None and blocked:
                    fast = lambda plan=plan: blocksparse_attention(q, k, v, plan)  # noqa: E731
                elif fast is None:
                    del plan
                    torch._dynamo.reset()  # one compilation per pattern: never past dynamo's recompile limit
                    t_plan, fast = flex_path(pred, q, k, v)
                t = best_time(fast, args.repeats, device=args.device)
            except Exception as e:  # noqa: BLE001  (one pattern's failure, e.g. out of memory, ends its row only)
                failed += 1
                print(f"{name:<28} {s / n ** 2:8.3%}  failed: "
                      f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
                continue
            td = min(dense, best_time(dense_call, 1, device=args.device))
            ratio, limit = td / t, dense_scores / s
            print(f"{name:<28} {s / n ** 2:8.3%} {1e3 * t_plan:9.1f} {1e3 * t:9.3f} {1e3 * td:9.3f} "
                  f"{ratio:6.2f} {limit:6.2f}  {'yes' if ratio >= limit / 2 else 'no'}")
    if failed:
        raise SystemExit(f"{failed} pattern(s) failed")

if __name__ == "__main__":
    main()
