"""Where the host's time goes in AHA decode on a GPU: the op (the bench's decode inputs, gates long-tailed
and uniform in turn) and a whole-model ``generate`` step (the bench's Llama-3.2-1B shape), each with a
cProfile of the Python and torch.profiler's CPU-side op counts. Prints markdown; writes it to --out.

    python3 benchmarks/host_probe.py --out runs/host_probe.md          # on a GPU, ~2 minutes
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from allhere.ops.aha.dispatch import aha_attention_fast
from allhere_recipes.ops_bench import bench_config, decode_inputs
from allhere_recipes.timing import stream_time


def python_profile(fn, calls: int, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000]


def op_counts(fn, top: int = 30) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="count", row_limit=top)


def probe_op(out: list[str], n: int) -> None:
    cfg = bench_config("cuda")
    out.append(f"## Decode op, B = {cfg.decode_batch}, n = {n}\n")
    inputs = {p: decode_inputs(cfg, n, p, 0.07) for p in ("long-tailed", "uniform")}
    for p, (q, k, v, gate) in inputs.items():
        out.append(f"- {p}: gate {gate.dtype} {tuple(gate.shape)} contiguous {gate.is_contiguous()} "
                   f"mu {gate.float().mean().item():.3f}")
    out += ["", "| order | gates | ms per call (200 back to back) | host ms per call |", "|---|---|---|---|"]
    with torch.no_grad():
        for i, p in enumerate(["long-tailed", "uniform", "long-tailed", "uniform"]):
            q, k, v, gate = inputs[p]
            per, host = stream_time(lambda: aha_attention_fast(q, k, v, gate, cfg.window), calls=200, device="cuda")
            out.append(f"| {i} | {p} | {1e3 * per:.4f} | {1e3 * host:.4f} |")
        q, k, v, gate = inputs["long-tailed"]
        call = lambda: aha_attention_fast(q, k, v, gate, cfg.window)  # noqa: E731
        out += ["", "cProfile, 200 calls, long-tailed:", "```", python_profile(call, 200), "```", ""]


def probe_model(out: list[str], ctx: int, batch: int) -> None:
    from allhere.hf import new_cache
    from allhere_recipes.generate_bench import decode_steps, fill, seed_kv
    from allhere_recipes.llama_bench import build_models, llama_tables

    t = llama_tables("cuda", contexts=(ctx,), batch=batch)
    start = time.perf_counter()
    plain, aha = build_models(t)
    del plain
    out.append(f"## Whole model (1B shape), AHA decode B = {batch}, context {ctx} (built in "
               f"{time.perf_counter() - start:.0f} s)\n")
    seed = seed_kv(aha, t.seed_tokens, "cuda")
    ids = torch.randint(0, aha.config.vocab_size, (batch, ctx + 1), device="cuda")
    cache = fill(new_cache(aha, reserve=ctx + 200), seed, batch, ctx)
    seq = ids
    for run in range(2):  # twice: is a first run slower?
        steps, seq, _ = decode_steps(aha, seq, cache, 16, 4)
        out.append(f"- run {run}: median step {1e3 * sorted(steps)[len(steps) // 2]:.2f} ms "
                   f"(min {1e3 * min(steps):.2f})")
    from allhere.hf.cache import cache_kwargs

    def step():
        nonlocal seq
        with torch.inference_mode():
            seq = aha.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=1, min_new_tokens=1,
                               do_sample=False, pad_token_id=0, **cache_kwargs(cache))

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    host_then = (time.perf_counter() - t0) / 5
    torch.cuda.synchronize()
    out.append(f"- generate of one token at a time: {1e3 * host_then:.2f} ms per call (host, then sync)")
    out += ["", "cProfile, 8 one-token generate calls:", "```", python_profile(step, 8, top=30), "```", "",
            "CPU ops of one one-token generate call (by count):", "```", op_counts(step), "```", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="host_probe.md")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    out = [f"# Host probe: {torch.cuda.get_device_name()}, torch {torch.__version__}\n"]
    try:
        probe_op(out, args.n)
        if not args.skip_model:
            probe_model(out, args.context, args.batch)
    finally:
        text = "\n".join(out)
        print(text)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
