"""The two comparison commands: ``allhere patterns``, the sparse attention family side by side (masks,
scores, receptive field, hops, KV cache, time against dense SDPA; ``allhere_recipes.sparse_patterns``),
and ``allhere compare``, the sparse patterns and AHA fine-tuned at about one attention budget
(``allhere_recipes.compare``)."""

from __future__ import annotations

import argparse

from . import args as a


def patterns_arguments(p: argparse.ArgumentParser) -> None:
    from allhere_recipes.sparse_family import KV_DTYPES, NAMES

    p.add_argument("--out", type=a.out_folder, default="runs/patterns",
                   help="folder for patterns.md / .json / _masks.png / _reach.png (default runs/patterns)")
    p.add_argument("--force", action="store_true",
                   help="replace the results of an earlier run in --out (default: refuse)")
    p.add_argument("--n", type=a.positive, default=2048,
                   help="sequence length of the graph figures: scores, receptive field, hops (default 2048)")
    p.add_argument("--window", type=a.positive, default=128, help="window w, the current token included (default 128)")
    p.add_argument("--dilations", type=a.positive, nargs="+", default=[1, 2, 4, 8],
                   help="dilation schedule of the dilated pattern, layer l uses D[l mod len] (default 1 2 4 8)")
    p.add_argument("--global-tokens", dest="n_global", type=a.positive_or_zero, default=64,
                   help="global tokens of Longformer (BigBird: ceil(G / block) global blocks) (default 64)")
    p.add_argument("--sinks", type=a.positive_or_zero, default=4,
                   help="attention sinks of the sliding + sinks pattern (default 4)")
    p.add_argument("--random-blocks", type=a.positive_or_zero, default=3,
                   help="BigBird random blocks per query block (default 3)")
    p.add_argument("--block", type=a.positive, default=64,
                   help="BigBird block, and the tile of the block-sparse op (default 64)")
    p.add_argument("--layers", type=a.positive, default=4,
                   help="layers of the receptive field; BigBird draws its random blocks per layer (default 4)")
    p.add_argument("--heads", type=a.positive, default=8,
                   help="heads: BigBird draws per head; KV cache and timing (default 8)")
    p.add_argument("--head-dim", type=a.positive, default=64,
                   help="head dimension of the KV cache and the timing (default 64)")
    p.add_argument("--kv-length", type=a.positive, default=32768,
                   help="generation length of the KV-cache figures (default 32768)")
    p.add_argument("--kv-dtype", default="bfloat16", choices=tuple(KV_DTYPES),
                   help="bytes per cached value (default bfloat16)")
    p.add_argument("--time-n", type=a.positive_or_zero, default=4096,
                   help="sequence length of the timing, 0 to skip it (default 4096)")
    a.repeats_flag(p, 5)
    p.add_argument("--encoder", action="store_true",
                   help="also the bidirectional (encoder) version of every pattern (default: decoder only)")
    p.add_argument("--device", type=a.device, default="cpu", help="device of the timing: cpu (default) or cuda[:N]")
    p.add_argument("--seed", type=a.positive_or_zero, default=0, help="seed of BigBird's random blocks (default 0)")
    p.add_argument("--patterns", nargs="+", choices=NAMES, default=list(NAMES),
                   help=f"some of {' '.join(NAMES)} (default all)")


def patterns(args) -> None:
    from allhere_recipes.sparse_patterns import render, run_patterns

    settings = {k: getattr(args, k) for k in ("n", "window", "n_global", "sinks", "random_blocks", "block",
                                               "layers", "heads", "head_dim", "kv_length", "kv_dtype", "time_n",
                                               "repeats", "encoder", "device", "seed", "force")}
    report = run_patterns(args.out, dilations=tuple(args.dilations), patterns=tuple(args.patterns), **settings)
    print(render(report))
    print(f"Written to {args.out}/: patterns.md, patterns.json, patterns_masks.png, patterns_reach.png")


def compare_arguments(p: argparse.ArgumentParser) -> None:
    from allhere_recipes.plans import PRESETS, TASKS

    p.add_argument("--out", type=a.out_folder, default="runs/demo",
                   help="the demo's run folder: its pretrained models are reused, or trained here and reused by "
                        "the demo (default runs/demo)")
    a.preset_flag(p, PRESETS)
    a.task_flag(p, "compare on", TASKS)
    p.add_argument("--steps", type=a.positive, default=100,
                   help="fine-tuning steps of every mechanism (default 100)")
    p.add_argument("--seeds", type=a.positive_or_zero, nargs="+", default=[0, 1, 2],
                   help="fine-tune every mechanism with each of these seeds (its batches, BigBird's random "
                        "blocks; one pretrained model for all); finished runs are reused (default 0 1 2)")
    a.data_flag(p)
    a.device_flag(p)
    a.report_flag(p)
    a.progress_flag(p)


def compare(args) -> None:
    from allhere_recipes.compare import render, run_compare
    from allhere_recipes.plans import TASKS

    from ..runtime.reporting import report_to

    with report_to(args.report_to, root=args.out):
        report = run_compare(args.out, args.preset, tuple(args.tasks or TASKS), args.steps, args.data, args.device,
                             not args.no_progress, seeds=args.seeds)
    print(render(report))
    print(f"Written to {args.out}/compare/: compare.md, compare.json, compare.png")
