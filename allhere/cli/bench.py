"""``allhere bench``: the AHA kernels against the fastest dense attention, and a whole model as a user runs it."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..validation import ConfigError
from . import args as a


def bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=a.device, default=None,
                   help="cuda[:N] (default: the first GPU), or cpu for a smoke run of the script")
    p.add_argument("--out", type=a.out_folder, default="runs/bench",
                   help="folder for bench.md and bench.json (default runs/bench)")
    p.add_argument("--force", action="store_true",
                   help="replace the bench.md and bench.json of an earlier run in --out (default: refuse)")
    p.add_argument("--tables", nargs="+", choices=("ops", "model"), default=["ops"],
                   help="what to measure: ops (the AHA op against dense SDPA: prefill, decode, training; the default) "
                        "and/or model (a Llama-3.2-1B-shaped model with random weights, plain against converted to "
                        "AHA at mu_f 7%%: prefill tokens/s, and decode tokens/s through generate on a filled cache; "
                        "on the CPU a smoke test at toy sizes)")
    p.add_argument("--llama-prefill", type=a.positive, nargs="+", default=None,
                   help="--tables model: prefill lengths (default 8192 32768; on the CPU 256)")
    p.add_argument("--llama-contexts", type=a.positive, nargs="+", default=None,
                   help="--tables model: decode contexts (default 32768 131072; on the CPU 128 256)")
    p.add_argument("--llama-batch", type=a.positive, default=None,
                   help="--tables model: decode batch (default 8; on the CPU 2)")
    p.add_argument("--llama-new-tokens", type=a.integer(2), default=None,
                   help="--tables model: decode steps timed per row (default 32; on the CPU 3)")
    p.add_argument("--lengths", type=a.positive, nargs="+", default=None,
                   help="prefill lengths (default 4096 16384 32768 65536)")
    p.add_argument("--decode-lengths", type=a.positive, nargs="+", default=None,
                   help="decode cache lengths (default 8192 32768 131072)")
    p.add_argument("--train-length", type=a.positive, default=None, help="training length (default 16384)")
    p.add_argument("--model-lengths", type=a.positive, nargs="+", default=None,
                   help="whole-model prefill lengths (default on the CPU 2048 4096 8192 16384; none on a GPU)")
    p.add_argument("--heads", type=a.positive, default=16, help="attention heads (default 16)")
    p.add_argument("--dim", type=a.positive, default=128, help="head dimension (default 128)")
    p.add_argument("--window", type=a.positive, default=256, help="AHA window w (default 256)")
    a.repeats_flag(p, 10)
    p.add_argument("--pin-tiles", action="store_true",
                   help="launch the Triton kernels with fixed settings (each kernel's first candidate this GPU runs) "
                        "instead of those autotuned on this GPU, for runs to compare over time (default: autotuned; "
                        "the first call of each shape class then times a handful of settings, reported in bench.md)")
    p.add_argument("--profile", action="store_true",
                   help="also profile each AHA path at the goals' shapes (prefill up to 32k, the longest decode, "
                        "training) and add where its time goes, op by op, to bench.md (default: off)")


def bench(args) -> None:
    from allhere_recipes.ops_bench import bench_config, render, run_bench, write_bench

    llama = dict(prefill_lengths=args.llama_prefill, contexts=args.llama_contexts, batch=args.llama_batch,
                 new_tokens=args.llama_new_tokens)
    cfg = bench_config(args.device, tables=args.tables, llama=llama, heads=args.heads, dim=args.dim,
                       window=args.window, repeats=args.repeats, prefill_lengths=args.lengths,
                       decode_lengths=args.decode_lengths, train_length=args.train_length,
                       model_lengths=args.model_lengths, profile=args.profile, pin_tiles=args.pin_tiles)
    if (Path(args.out) / "bench.json").exists() and not args.force:
        raise ConfigError(f"--out {args.out} holds the results of an earlier bench; pass --force to replace "
                          "them, or choose another folder (nothing was written)")
    report = run_bench(cfg)
    write_bench(report, args.out)
    print(render(report))
    print(f"Written to {args.out}/bench.md and bench.json")
