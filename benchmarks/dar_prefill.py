"""DAR attention forward (training-time formulation) on the CPU: the blocked op against its dense
reference and against plain causal SDPA (vanilla attention), side by side in one run.

    python benchmarks/dar_prefill.py            # 16 heads x 64 dims, w = 128, n in {1k, 4k}, fp32, B = 1

Prints, per sequence length: time of causal SDPA over one K/V set (what vanilla attention costs), the
blocked DAR op (two K/V sets, one softmax) and the dense reference, each the median of --repeats runs after
a warm-up, and the ratios. The blocked op is checked against the reference first.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from allhere.ops.dar import dar_attention, dar_attention_reference
from allhere_recipes.timing import median_time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, heads={a.heads}, dim={a.dim}, "
          f"w={a.window}, fp32, B=1")
    print("| n | causal SDPA | DAR blocked | DAR dense reference | blocked / SDPA | reference / blocked |")
    print("|---|---|---|---|---|---|")
    for n in a.lengths:
        q, kn, vn, kf, vf = (torch.randn(1, a.heads, n, a.dim) for _ in range(5))
        with torch.no_grad():
            if n == a.lengths[0]:
                ref = dar_attention_reference(q, kn, vn, kf, vf, a.window)
                err = (dar_attention(q, kn, vn, kf, vf, a.window) - ref).norm() / ref.norm()
                assert err < 1e-5, f"blocked DAR differs from the reference: rel. error {err:.2e}"
            sdpa = median_time(lambda: F.scaled_dot_product_attention(q, kn, vn, is_causal=True), a.repeats)
            fast = median_time(lambda: dar_attention(q, kn, vn, kf, vf, a.window), a.repeats)
            naive = median_time(lambda: dar_attention_reference(q, kn, vn, kf, vf, a.window), a.repeats)
        print(f"| {n} | {1e3 * sdpa:.1f} ms | {1e3 * fast:.1f} ms | {1e3 * naive:.1f} ms | "
              f"{fast / sdpa:.2f}x | {naive / fast:.2f}x |")


if __name__ == "__main__":
    main()
