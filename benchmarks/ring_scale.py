"""Ring attention at scale, per rank: rounds, bytes, FLOPs and memory of one attention layer, from the
cost model (``allhere_recipes.cost``), which walks the same plan the ring executes.

    python benchmarks/ring_scale.py                 # markdown table on stdout
    python benchmarks/ring_scale.py --out table.md  # and into a file

Model shape: batch 1, 32 query heads, 8 kv heads, head dim 128, bf16 (a Llama-3-8B-like layer); zigzag
layout. Mechanisms: full causal; sliding window w; Longformer (window w + the first 64 tokens global,
"Longformer: The Long-Document Transformer", arXiv:2004.05150); AHA with mu_f = 7% of every chunk's rows
global in each head, spread evenly (fixed gate), and with the gate trained (two more forward-only passes
for the straight-through gradient). Nothing is run: these are counts, not timings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from allhere_recipes.cost import Shape, mechanism_plan, saved_bytes, summary

GIB, MIB = 2 ** 30, 2 ** 20


def rows(lengths, worlds, window, mu_f, shape, layout="zigzag"):
    for n in lengths:
        single = saved_bytes(shape, n, 1)
        for d in worlds:
            full = None
            for mech in ("full", "sliding", "longformer", "aha", "aha (gate trained)"):
                plan, sel, extra = mechanism_plan(mech, n, d, layout, shape, window, mu_f)
                s = summary(plan, shape, sel, extra)
                full = full or s
                yield (f"| {mech} | {n // 1024}k | {d} | {s['rounds']} | {s['received'] / GIB:.2f} | "
                       f"{s['sent'] / GIB:.2f} | {s['flops'] / 1e12:.1f} | {s['flops'] / full['flops']:.3f} | "
                       f"{s['saved'] / MIB:.0f} | {s['saved'] / single:.3f} | {s['peak'] / GIB:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--mu-f", type=float, default=0.07)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    shape = Shape()
    head = ("| mechanism | n | ranks d | rounds/rank | received GiB/rank | sent GiB/rank | attn TFLOP/rank | "
            "FLOPs vs full | saved MiB/rank | saved vs 1 process | fwd working set GiB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head, *rows(a.lengths, a.worlds, a.window, a.mu_f, shape)]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out is not None:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
