"""AHA inference forward vs dense causal SDPA on the CPU, ratios measured side by side in one run.

    python benchmarks/cpu_prefill.py            # 16 heads x 64 dims, w = 256, mu_f ~ 7%, n in {2k, 8k}

Prints, per sequence length and gate pattern: dense SDPA time, AHA time (``aha_attention`` on backend
"torch", the PyTorch path), the speed-up and the FLOP limit 1 / (mu + 2 (1 - mu) w / n). Each time is the
median of --repeats runs after one warm-up.
Before timing, the fast path is checked against the dense reference at the smallest length.

    python benchmarks/cpu_prefill.py --training --lengths 2048 4096   # forward + backward instead
    python benchmarks/cpu_prefill.py --padded --lengths 1024 2048     # a left-padded batch of 4
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F

from allhere.masks import segment_starts
from allhere.ops.aha import aha_attention, aha_attention_reference
from allhere.ops.aha.fast import aha_attention_torch
from allhere.ops.ste import straight_through
from allhere_recipes.gates import PATTERNS, flop_limit
from allhere_recipes.timing import median_time


def fast(q, k, v, gate, window, **kw):
    return aha_attention(q, k, v, gate, window, backend="torch", **kw)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--mu", type=float, default=0.07)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    p.add_argument("--training", action="store_true",
                   help="time training forward + backward (straight-through gate) instead of inference")
    p.add_argument("--padded", action="store_true",
                   help="a left-padded batch (B = 4, padding 0, n/16, n/4, n/2): the padding mask through the "
                        "dense reference against the fast op per segment (segment_starts)")
    a = p.parse_args(argv)
    if a.training:
        return training_table(a)
    if a.padded:
        return padded_table(a)
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, heads={a.heads}, dim={a.dim}, w={a.window}, fp32, B=1")

    n0 = min(a.lengths)  # correctness before speed
    q, k, v = (torch.randn(1, a.heads, n0, a.dim) for _ in range(3))
    gate = PATTERNS[a.patterns[0]](1, a.heads, n0, a.mu)
    err = (fast(q, k, v, gate, a.window) - aha_attention_reference(q, k, v, gate, a.window)).abs().max()
    print(f"# check at n={n0}: max |fast - reference| = {err.item():.2e}")
    if err > 1e-4:
        raise SystemExit("fast path disagrees with the reference")

    print("| n | gates | mu_f | dense SDPA ms | AHA fast ms | speed-up | FLOP limit |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for n in a.lengths:
            q, k, v = (torch.randn(1, a.heads, n, a.dim) for _ in range(3))
            t_dense = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), a.repeats)
            for name in a.patterns:
                gate = PATTERNS[name](1, a.heads, n, a.mu)
                mu = gate.float().mean().item()
                t_aha = median_time(lambda: fast(q, k, v, gate, a.window), a.repeats)
                print(f"| {n} | {name} | {mu:.3f} | {t_dense * 1e3:.1f} | {t_aha * 1e3:.1f} | "
                      f"{t_dense / t_aha:.2f}x | {flop_limit(mu, a.window, n):.1f}x |", flush=True)


def training_table(a) -> None:
    """Forward + backward: dense causal SDPA against AHA with the straight-through gate on the PyTorch
    path, its backward dense (both outputs with autograd; what it picks on CUDA) and sparse (autograd only
    through the outputs used; what it picks off CUDA)."""
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, heads={a.heads}, dim={a.dim}, "
          f"w={a.window}, fp32, B=1, forward + backward")
    print("| n | gates | mu_f | dense SDPA ms | AHA dense backward ms | AHA sparse backward ms | dense / sparse |")
    print("|---|---|---|---|---|---|---|")
    for n in a.lengths:
        q, k, v = (torch.randn(1, a.heads, n, a.dim, requires_grad=True) for _ in range(3))
        up = torch.randn(1, a.heads, n, a.dim)

        def step(fn, *extra):
            torch.autograd.grad((fn() * up).sum(), [q, k, v, *extra])

        t_dense = median_time(lambda: step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), a.repeats)
        for name in a.patterns:
            gate = PATTERNS[name](1, a.heads, n, a.mu)
            s = (gate.float() * 0.5 + 0.25).requires_grad_()  # s > 0.5 exactly where the gate is global
            ste = lambda: straight_through(s, 0.5)  # noqa: E731
            scale = a.dim ** -0.5
            times = [median_time(lambda: step(lambda: aha_attention_torch(q, k, v, ste(), a.window, scale,
                                                                           sparse_backward=sb), s), a.repeats)
                     for sb in (False, True)]
            print(f"| {n} | {name} | {gate.float().mean().item():.3f} | {t_dense * 1e3:.1f} | {times[0] * 1e3:.1f} | "
                  f"{times[1] * 1e3:.1f} | {t_dense / times[1]:.2f}x |", flush=True)


def padded_table(a) -> None:
    """A left-padded batch, as a Hugging Face model gets it: the mask through the dense reference (what
    every padded batch ran before) against the fast op on each sequence's real part (the segment starts
    read from the mask), and dense SDPA under the same mask."""
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, heads={a.heads}, dim={a.dim}, "
          f"w={a.window}, mu_f ~{a.mu}, fp32, B=4 left-padded by 0, n/16, n/4, n/2")
    print("| n | gates | dense SDPA + mask ms | AHA reference + mask ms | AHA fast per segment ms | fast vs reference "
          "| max abs. diff. |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for n in a.lengths:
            q, k, v = (torch.randn(4, a.heads, n, a.dim) for _ in range(3))
            pos = torch.arange(n)
            mask = torch.stack([(pos[None, :] <= pos[:, None]) & (pos[None, :] >= s) & (pos[:, None] >= s)
                                for s in (0, n // 16, n // 4, n // 2)])[:, None]
            starts = segment_starts(mask, n, n)
            t_sdpa = median_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), a.repeats)
            for name in a.patterns:
                gate = PATTERNS[name](4, a.heads, n, a.mu)
                per_segment = lambda: fast(q, k, v, gate, a.window, row_start=starts)  # noqa: E731
                ref = aha_attention_reference(q, k, v, gate, a.window, mask=mask)
                err = (per_segment() - ref).abs().max().item()
                t_ref = median_time(lambda: aha_attention_reference(q, k, v, gate, a.window, mask=mask), a.repeats)
                t_fast = median_time(per_segment, a.repeats)
                print(f"| {n} | {name} | {t_sdpa * 1e3:.0f} | {t_ref * 1e3:.0f} | {t_fast * 1e3:.0f} | "
                      f"{t_ref / t_fast:.1f}x | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
