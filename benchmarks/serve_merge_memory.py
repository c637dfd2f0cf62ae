"""Peak memory and time of one long prefill chunk through ``allhere.ops.paged.attention.paged_attention``, with the
pieces merged as they come past ``allhere.ops.paged.chunks.MERGE_BUDGET`` against all of them held until the end.

    python benchmarks/serve_merge_memory.py            # 2048 queries at 32k context, full attention

Each budget runs in a process of its own (peak RSS is per process). Plain torch on the CPU, one thread.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

HELD = 1 << 40  # a budget nothing reaches: every piece held until the end


def one(budget: int, ctx: int, chunk: int) -> None:
    import torch

    from allhere.ops.paged import chunks
    from allhere.ops.paged.attention import causal_read, paged_attention, paged_view

    torch.set_num_threads(1)
    chunks.MERGE_BUDGET = budget
    heads, kv_heads, d, bs = 16, 4, 64, 128
    blocks = ctx // bs
    view = paged_view(torch.randn(blocks * kv_heads * 2 * bs * d), bs, kv_heads, d)
    q, out = torch.randn(chunk, heads, d), torch.empty(chunk, heads, d)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    paged_attention(q, view, torch.tensor([0, chunk]), torch.tensor([ctx]), torch.arange(blocks)[None],
                    [[causal_read()]], d ** -0.5, out)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    label = "held to the end" if budget >= HELD else f"merged past {budget >> 20} MB"
    print(f"| {label} | {time.perf_counter() - t0:.2f} | {grew:.0f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a budget, in the child process
    args = p.parse_args()
    if args.one is not None:
        return one(args.one, args.context, args.chunk)
    from allhere.ops.paged.chunks import MERGE_BUDGET

    print(f"# {args.chunk} queries at {args.context} context, 16 heads / 4 KV heads of 64, full attention, "
          f"fp32, 1 thread; load average {os.getloadavg()[0]:.2f}")
    print("| pieces | seconds | peak RSS growth, MB |\n|---|---|---|", flush=True)
    for budget in (HELD, MERGE_BUDGET):
        subprocess.run([sys.executable, __file__, "--one", str(budget), "--context", str(args.context), "--chunk",
                        str(args.chunk)], check=True)


if __name__ == "__main__":
    main()
