"""Command line: a table of commands (name, help, its arguments, what it runs). Each command calls an
experiment (``allhere.experiments``) or the library and prints the result; known errors become one line
``allhere <command>: error: ...`` on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from .checkpoint import CheckpointError
from .config import ConfigError
from .data.corpus import DataError
from .experiments.plans import PRESETS, TASKS

KNOWN_ERRORS = (ConfigError, DataError, CheckpointError, ImportError)
DEVICE_HELP = "auto (default: the first GPU if there is one, else cpu), cpu or cuda[:N]"


# Argument types ---------------------------------------------------------------------------------------

def _device(value: str) -> str:
    if value == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if value != "cpu" and not value.startswith("cuda"):
        raise argparse.ArgumentTypeError(f"--device must be auto, cpu or cuda[:N], got {value!r}")
    return value


def _int_at_least(low: int):
    def parse(value: str) -> int:
        n = int(value)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return n

    parse.__name__ = "integer"  # argparse names it in "invalid integer value"
    return parse


_positive, _positive_or_zero = _int_at_least(1), _int_at_least(0)


def _nonnegative_float(value: str) -> float:
    x = float(value)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return x


def _fraction(value: str) -> float:
    x = float(value)
    if not 0.0 < x < 1.0:
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {value}")
    return x


# Shared flags -----------------------------------------------------------------------------------------

DATA_HELP = ("your own text instead of the stdlib corpus: a file, a folder of text files, or a datasets "
             "folder saved with save_to_disk (column 'text'); default: the stdlib corpus")


def _task_flag(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--task", dest="tasks", action="append", choices=TASKS,
                   help=f"{verb} only this task (repeatable); default both")


def _preset_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cpu", choices=PRESETS,
                   help="sizes and steps: cpu (default, ~15 min on 2 cores), tiny (seconds), gpu")


def _progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: shown)")


def _conversion_flags(p: argparse.ArgumentParser, kinds: tuple[str, ...]) -> None:
    p.add_argument("--mechanism", default="aha", choices=kinds, help=f"{' or '.join(kinds)} (default aha)")
    p.add_argument("--window", type=_positive_or_zero, required=True,
                   help="window w (keys, the current one included); DAR also takes 0 (uniform reduction)")
    p.add_argument("--tau", type=float, default=None, help="AHA gate threshold (default 0.5)")
    p.add_argument("--lam", type=_nonnegative_float, default=None, help="AHA lambda of L_reg (default 3e-4)")
    p.add_argument("--d-down", type=_positive, default=None,
                   help="DAR bottleneck width (required with dar; no default)")


def _mechanism(args):
    """The mechanism config the conversion flags ask for, from the registry: each flag sets the field of
    the same name; a flag the mechanism has no field for is an error, not silently ignored."""
    import dataclasses

    from . import registry

    cls = registry.get(args.mechanism).config
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    given = {k: getattr(args, k) for k in ("window", "tau", "lam", "d_down") if getattr(args, k) is not None}
    foreign = sorted(set(given) - fields)
    if foreign:
        flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
        raise ConfigError(f"{flags} {'is not a setting' if len(foreign) == 1 else 'are not settings'} of "
                          f"--mechanism {args.mechanism}")
    if "d_down" in fields and "d_down" not in given:
        raise ConfigError(f"--mechanism {args.mechanism} needs --d-down (the bottleneck width, e.g. hidden size / 4)")
    return cls(**given)


def _hf_kinds() -> tuple[str, ...]:
    from . import registry

    return tuple(k for k in registry.kinds() if registry.get(k).module.hf_support)


# demo -------------------------------------------------------------------------------------------------

def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo",
                   help="run directory, reused and resumed when the settings match (default runs/demo)")
    _preset_flag(p)
    _task_flag(p, "run")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)
    p.add_argument("--window", type=_positive, default=None,
                   help="AHA / sliding window w (default: the preset's; tiny 8, else 32 for stdlib and 16 for recall)")
    p.add_argument("--lam", type=_nonnegative_float, default=None,
                   help="lambda of L_reg (default: the preset's; tiny 0.01, else 0.05)")
    p.add_argument("--pretrain-steps", type=_positive, default=None,
                   help="optimizer steps of the full model's pretraining (default: the preset's; tiny 6, "
                        "cpu 800 for stdlib and 400 for recall, gpu 3000 and 400)")
    p.add_argument("--finetune-steps", type=_positive, default=None,
                   help="optimizer steps of the AHA fine-tuning and its control (default: the preset's; tiny 4, "
                        "cpu 250 for stdlib and 200 for recall, gpu 1000 and 200)")
    _progress_flag(p)
    p.add_argument("--mechanism", default="aha", choices=["aha", "dar"],
                   help="aha (default): the AHA demo; dar: DAR against vanilla and uniform reduction")
    p.add_argument("--windows", type=_positive, nargs="+", default=None,
                   help="with --mechanism dar: the DAR windows to compare (default 1 4 16 32 64 128)")
    p.add_argument("--from-scratch", action="store_true",
                   help="with --mechanism dar: also train DAR and uniform reduction from scratch with the "
                        "vanilla model's pretraining budget (default: off)")


def _check_demo_flags(args) -> None:
    """A flag of the other demo is an error, not silently ignored."""
    only = {"aha": {"window": "--window", "lam": "--lam", "pretrain_steps": "--pretrain-steps",
                    "finetune_steps": "--finetune-steps", "tasks": "--task"},
            "dar": {"windows": "--windows", "from_scratch": "--from-scratch"}}
    other = "dar" if args.mechanism == "aha" else "aha"
    given = [flag for name, flag in only[other].items() if getattr(args, name, None) not in (None, False)]
    if given:
        raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
                          f"`allhere demo --mechanism {other}`, not --mechanism {args.mechanism}")


def demo(args) -> None:
    _check_demo_flags(args)
    if args.mechanism == "dar":
        from .experiments.dar_demo import render, run_dar_demo

        report = run_dar_demo(out=args.out, preset=args.preset, data_path=args.data, device=args.device,
                              progress=not args.no_progress, from_scratch=args.from_scratch,
                              **({"windows": args.windows} if args.windows else {}))
        print(render(report))
        print(f"Report written to {args.out}/dar_report.md and dar_report.json")
        return
    from .experiments.demo import render, run_demo

    report = run_demo(out=args.out, preset=args.preset, tasks=tuple(args.tasks or TASKS), data_path=args.data,
                      device=args.device, progress=not args.no_progress, window=args.window, lam=args.lam,
                      pretrain_steps=args.pretrain_steps, finetune_steps=args.finetune_steps)
    print(render(report))
    print(f"Report written to {args.out}/report.md, report.json and mu_f_heatmap.png")


# analyze ----------------------------------------------------------------------------------------------

def analyze_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default="runs/demo", help="a finished demo run directory (default runs/demo)")
    _task_flag(p, "analyse")
    p.add_argument("--target-mu", type=_fraction, default=None,
                   help="also calibrate tau for this share of full attention (0 < x < 1) and report where it "
                        "lands (default: no calibration)")


def analyze(args) -> None:
    from .experiments.analyze import analyze_run, render

    results = analyze_run(args.run, tuple(args.tasks or TASKS), args.target_mu)
    print(render(results))
    print(f"Written to {args.run}/analysis/: analysis.md, analysis.json, sorted_usage.png, tokens_*.html")


# sweep ------------------------------------------------------------------------------------------------

def sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/sweep", help="sweep directory, reused and resumed (default runs/sweep)")
    _preset_flag(p)
    p.add_argument("--windows", type=_positive, nargs="+", default=[16, 32, 64, 128, 256],
                   help="windows of the window sweep (default 16 32 64 128 256)")
    p.add_argument("--lams", type=_nonnegative_float, nargs="+", default=[1e-4, 3e-4, 1e-3],
                   help="lambdas of the lambda sweep (default 1e-4 3e-4 1e-3)")
    p.add_argument("--lam-window", type=_positive, default=None,
                   help="window of the lambda sweep (default: the preset's AHA window of each task)")
    _task_flag(p, "sweep")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)
    _progress_flag(p)


def sweep(args) -> None:
    from .experiments.sweep import render, run_sweep

    res = run_sweep(args.out, args.preset, tuple(args.windows), tuple(args.lams), args.lam_window,
                    tuple(args.tasks or TASKS), args.data, args.device, not args.no_progress)
    print(render(res))
    print(f"Written to {args.out}/: sweep.md, sweep.json, mu_f_vs_window.png")


# perplexity -------------------------------------------------------------------------------------------

def perplexity_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint",
                       help="an allhere checkpoint.safetensors (e.g. runs/demo/stdlib/aha/...); this or --model")
    which.add_argument("--model",
                       help="a Hugging Face model folder (plain, or saved by allhere convert / sft); this or "
                            "--checkpoint")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--seq-len", type=_positive, default=256, help="window length (default 256)")
    p.add_argument("--stride", type=_positive, default=None, help="window advance (default seq-len / 2)")
    p.add_argument("--min-len", type=int, default=0,
                   help="skip documents shorter than this, e.g. the AHA window (default 0: none skipped)")
    p.add_argument("--max-docs", type=_positive, default=None,
                   help="only the first N validation documents (default: all)")


def perplexity(args) -> None:
    from .checkpoint import load_model
    from .data.corpus import stdlib_corpus, text_corpus
    from .eval.perplexity import hf_perplexity, rolling_perplexity

    corpus = stdlib_corpus() if args.data is None else text_corpus(args.data)
    docs = corpus.val_docs[: args.max_docs]
    if args.model is not None:
        res = hf_perplexity(args.model, docs, args.seq_len, args.stride, args.min_len)
    else:
        res = rolling_perplexity(load_model(args.checkpoint)[0], docs, args.seq_len, args.stride, args.min_len)
    mu = "" if res["mu_f"] is None else f", mu_f {100 * res['mu_f']:.1f}%"
    print(f"{res['tokens']:,} tokens in {len(docs) - res['skipped_docs']} documents "
          f"({res['skipped_docs']} skipped): loss {res['loss']:.4f} nats, perplexity {res['perplexity']:.3f}, "
          f"{res['bits_per_token']:.4f} bits/token{mu}")


# eval -------------------------------------------------------------------------------------------------

def eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="an allhere checkpoint (.safetensors) or a transformers folder")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None,
                   help="folder of your own lm-eval task YAMLs (default: lm-eval's tasks only)")
    p.add_argument("--limit", type=_positive, default=None,
                   help="only the first N documents of each task (default: all)")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples per prompt (default: each task's own setting)")
    p.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda[:N] or auto")


def evaluate(args) -> None:
    from .eval.harness import evaluate as harness

    results = harness(args.model, args.tasks.split(","), args.include_path, args.limit, args.device,
                      args.num_fewshot)
    for task, metrics in results.items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and "stderr" not in k)
        print(f"{task}: {shown}")


# bench ------------------------------------------------------------------------------------------------

def bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device, default=None,
                   help="cuda[:N] (default: the first GPU), or cpu for a smoke run of the script")
    p.add_argument("--out", default="runs/bench", help="folder for bench.md and bench.json (default runs/bench)")
    p.add_argument("--lengths", type=_positive, nargs="+", default=None,
                   help="prefill lengths (default 4096 16384 32768 65536)")
    p.add_argument("--decode-lengths", type=_positive, nargs="+", default=None,
                   help="decode cache lengths (default 8192 32768 131072)")
    p.add_argument("--train-length", type=_positive, default=None, help="training length (default 16384)")
    p.add_argument("--heads", type=_positive, default=16, help="attention heads (default 16)")
    p.add_argument("--dim", type=_positive, default=128, help="head dimension (default 128)")
    p.add_argument("--window", type=_positive, default=256, help="AHA window w (default 256)")
    p.add_argument("--repeats", type=_positive, default=10, help="timed calls per measurement, median (default 10)")


def bench(args) -> None:
    from .experiments.bench import bench_config, render, run_bench, write_bench

    cfg = bench_config(args.device, heads=args.heads, dim=args.dim, window=args.window, repeats=args.repeats,
                       prefill_lengths=args.lengths, decode_lengths=args.decode_lengths,
                       train_length=args.train_length)
    report = run_bench(cfg)
    write_bench(report, args.out)
    print(render(report))
    print(f"Written to {args.out}/bench.md and bench.json")


# convert, sft -----------------------------------------------------------------------------------------

def convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="folder of a saved transformers causal LM")
    p.add_argument("--out", required=True, help="folder to save the converted model into")
    _conversion_flags(p, _hf_kinds())


def convert(args) -> None:
    from .hf import convert as hf_convert
    from .hf import save_pretrained
    from .hf.io import load_local

    from pathlib import Path

    mech = _mechanism(args)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # never overwrite a model (or the input)
        raise ConfigError(f"--out {out} already exists and is not an empty folder; choose a new folder "
                          "(nothing was written)")
    tokenizer, model = load_local(args.model)
    hf_convert(model, mech)
    save_pretrained(model, args.out)
    tokenizer.save_pretrained(args.out)
    print(f"{args.mechanism.upper()} model ({mech}) saved to {args.out}; load it with allhere.hf.load_pretrained")


def sft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="folder of a saved transformers causal LM")
    p.add_argument("--data", required=True, help="chat data: .jsonl/.json/.parquet with a 'messages' column")
    p.add_argument("--out", required=True, help="run folder: checkpoint(s) and the final model/")
    _conversion_flags(p, ("aha", "dar"))  # the fine-tuning recipes allhere.hf.sft knows
    p.add_argument("--seq-len", type=_positive, default=2048, help="packed sequence length (default 2048)")
    p.add_argument("--batch-size", type=_positive, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--global-batch", type=_positive, default=128, help="sequences per optimizer step (default 128)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    p.add_argument("--max-steps", type=_positive, default=None,
                   help="stop after this many optimizer steps (default: when the epochs are done)")
    p.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (default 3e-5; DAR: stage 2)")
    p.add_argument("--stage1-lr", type=float, default=3e-4,
                   help="DAR stage 1 (bottleneck only) learning rate (default 3e-4)")
    p.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out where it stopped (default: start a new run)")
    _progress_flag(p)


def sft(args) -> None:
    from .hf import sft as run_sft

    mech = _mechanism(args)
    state = run_sft(args.model, args.data, args.out, window=args.window, seq_len=args.seq_len,
                    batch_size=args.batch_size, global_batch=args.global_batch, epochs=args.epochs, lr=args.lr,
                    lam=getattr(mech, "lam", 3e-4), tau=getattr(mech, "tau", 0.5), max_steps=args.max_steps, device=args.device, resume=args.resume,
                    progress=not args.no_progress, d_down=getattr(mech, "d_down", None), stage1_lr=args.stage1_lr)
    last = state["history"][-1]
    mu = f", mu_f {last['mu_f']:.3f}" if last.get("mu_f") is not None else ""
    print(f"{state['step']} steps; last step: loss {last['lm']:.4f}{mu}. Model saved to {args.out}/model")


# The table --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


COMMANDS = (
    Command("demo", "pretrain a full model, swap in AHA, fine-tune, evaluate, write a report",
            demo_arguments, demo),
    Command("analyze", "routing statistics, sorted-usage curve and static baseline of a demo run",
            analyze_arguments, analyze),
    Command("sweep", "window and lambda sweeps (Tables 1, 2, 4 of the AHA paper, \"Learning When Not to Attend "
            "Globally\"), resumable", sweep_arguments, sweep),
    Command("perplexity", "rolling-window perplexity of a checkpoint on held-out documents",
            perplexity_arguments, perplexity),
    Command("eval", "lm-evaluation-harness tasks, with mu_f next to each task's metrics", eval_arguments, evaluate),
    Command("bench", "AHA prefill / decode / training against the fastest dense attention (GPU)",
            bench_arguments, bench),
    Command("convert", "convert a local Hugging Face model to AHA or DAR and save it", convert_arguments, convert),
    Command("sft", "convert a local Hugging Face model to AHA or DAR and fine-tune it on chat data",
            sft_arguments, sft),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="allhere", description="Local and global attention for decoder-only LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)
    try:
        command.run(args)
    except KNOWN_ERRORS as e:
        print(f"allhere {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
