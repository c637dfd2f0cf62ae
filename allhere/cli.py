"""Command line: parse arguments, call the library, turn known errors into one line and exit code 2."""

from __future__ import annotations

import argparse
import sys

from .checkpoint import CheckpointError
from .config import ConfigError
from .data.corpus import DataError


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="allhere", description="Local and global attention for decoder-only LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="pretrain a full model, swap in AHA, fine-tune, evaluate, write a report")
    d.add_argument("--out", default="runs/demo", help="run directory (reused and resumed when settings match)")
    d.add_argument("--preset", default="cpu", choices=["cpu", "tiny", "gpu"],
                   help="sizes and steps: cpu (~15 min on 2 cores), tiny (seconds), gpu")
    d.add_argument("--task", dest="tasks", action="append", choices=["stdlib", "recall"],
                   help="run only this task (repeatable); default both")
    d.add_argument("--data", default=None,
                   help="your own text instead of the stdlib corpus: a file, a folder of text files, or a "
                        "datasets folder saved with save_to_disk (column 'text')")
    d.add_argument("--device", type=_device, default="auto", help="auto (default), cpu or cuda[:N]")
    d.add_argument("--window", type=_positive, default=None, help="AHA / sliding window w (overrides the preset)")
    d.add_argument("--lam", type=_nonnegative_float, default=None, help="lambda of L_reg (overrides the preset)")
    d.add_argument("--pretrain-steps", type=_positive, default=None)
    d.add_argument("--finetune-steps", type=_positive, default=None)
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.add_argument("--mechanism", default="aha", choices=["aha", "dar"],
                   help="aha (default): the AHA demo; dar: DAR against vanilla and uniform reduction")
    d.add_argument("--windows", type=_positive, nargs="+", default=None,
                   help="with --mechanism dar: the DAR windows to compare (default 1 4 16 32 64 128)")
    d.add_argument("--from-scratch", action="store_true",
                   help="with --mechanism dar: also train DAR and uniform reduction from scratch with the "
                        "vanilla model's pretraining budget")

    a = sub.add_parser("analyze", help="routing statistics, sorted-usage curve and static baseline of a demo run")
    a.add_argument("--run", default="runs/demo", help="a finished demo run directory")
    a.add_argument("--task", dest="tasks", action="append", choices=["stdlib", "recall"],
                   help="analyse only this task (repeatable); default both")
    a.add_argument("--target-mu", type=_fraction, default=None,
                   help="also calibrate tau for this share of full attention (0 < x < 1) and report where it lands")

    w = sub.add_parser("sweep", help="window and lambda sweeps (Tables 1, 2, 4 of seeds/003), resumable")
    w.add_argument("--out", default="runs/sweep", help="sweep directory (reused and resumed)")
    w.add_argument("--preset", default="cpu", choices=["cpu", "tiny", "gpu"])
    w.add_argument("--windows", type=_positive, nargs="+", default=[16, 32, 64, 128, 256])
    w.add_argument("--lams", type=_nonnegative_float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    w.add_argument("--lam-window", type=_positive, default=None, help="window of the lambda sweep (default: preset's)")
    w.add_argument("--task", dest="tasks", action="append", choices=["stdlib", "recall"])
    w.add_argument("--data", default=None, help="your own text instead of the stdlib corpus")
    w.add_argument("--device", type=_device, default="auto")
    w.add_argument("--no-progress", action="store_true")

    e = sub.add_parser("perplexity", help="rolling-window perplexity of a checkpoint on held-out documents")
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="an allhere checkpoint.safetensors (e.g. runs/demo/stdlib/aha/...)")
    which.add_argument("--model", help="a Hugging Face model folder (plain, or saved by allhere convert / sft)")
    e.add_argument("--data", default=None, help="text data as for demo --data; default the stdlib corpus")
    e.add_argument("--seq-len", type=_positive, default=256, help="window length (default 256)")
    e.add_argument("--stride", type=_positive, default=None, help="window advance (default seq-len / 2)")
    e.add_argument("--min-len", type=int, default=0, help="skip documents shorter than this (e.g. the AHA window)")
    e.add_argument("--max-docs", type=_positive, default=None, help="only the first N validation documents")

    v = sub.add_parser("eval", help="lm-evaluation-harness tasks, with mu_f next to each task's metrics")
    v.add_argument("--model", required=True, help="an allhere checkpoint (.safetensors) or a transformers folder")
    v.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    v.add_argument("--include-path", default=None, help="folder of your own lm-eval task YAMLs")
    v.add_argument("--limit", type=_positive, default=None, help="only the first N documents of each task")
    v.add_argument("--num-fewshot", type=int, default=None)
    v.add_argument("--device", type=_device, default="cpu")

    bn = sub.add_parser("bench", help="AHA prefill / decode / training against the fastest dense attention (GPU)")
    bn.add_argument("--device", type=_device, default=None,
                    help="cuda[:N] (default: the first GPU), or cpu for a smoke run of the script")
    bn.add_argument("--out", default="runs/bench", help="folder for bench.md and bench.json")
    bn.add_argument("--lengths", type=_positive, nargs="+", default=None, help="prefill lengths (default 4k..64k)")
    bn.add_argument("--decode-lengths", type=_positive, nargs="+", default=None, help="decode cache lengths")
    bn.add_argument("--train-length", type=_positive, default=None, help="training length (default 16384)")
    bn.add_argument("--heads", type=_positive, default=16)
    bn.add_argument("--dim", type=_positive, default=128)
    bn.add_argument("--window", type=_positive, default=256)
    bn.add_argument("--repeats", type=_positive, default=10)

    c = sub.add_parser("convert", help="convert a local Hugging Face model to AHA or DAR and save it")
    c.add_argument("--model", required=True, help="folder of a saved transformers causal LM")
    c.add_argument("--out", required=True, help="folder to save the converted model into")
    _conversion_flags(c)

    s = sub.add_parser("sft", help="convert a local Hugging Face model to AHA or DAR and fine-tune it on chat data")
    s.add_argument("--model", required=True, help="folder of a saved transformers causal LM")
    s.add_argument("--data", required=True, help="chat data: .jsonl/.json/.parquet with a 'messages' column")
    s.add_argument("--out", required=True, help="run folder: checkpoint(s) and the final model/")
    _conversion_flags(s)
    s.add_argument("--seq-len", type=_positive, default=2048, help="packed sequence length (default 2048)")
    s.add_argument("--batch-size", type=_positive, default=4, help="sequences per micro-batch (default 4)")
    s.add_argument("--global-batch", type=_positive, default=128, help="sequences per optimizer step (default 128)")
    s.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    s.add_argument("--max-steps", type=_positive, default=None, help="stop after this many optimizer steps")
    s.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (default 3e-5; DAR: stage 2)")
    s.add_argument("--stage1-lr", type=float, default=3e-4, help="DAR stage 1 (bottleneck only) learning rate (default 3e-4)")
    s.add_argument("--device", type=_device, default="auto", help="auto (default), cpu or cuda[:N]")
    s.add_argument("--resume", action="store_true", help="continue the run in --out where it stopped")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _conversion_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mechanism", default="aha", choices=["aha", "dar"], help="aha (default) or dar")
    p.add_argument("--window", type=_positive_or_zero, required=True,
                   help="window w (keys, the current one included); DAR also takes 0 (uniform reduction)")
    p.add_argument("--tau", type=float, default=0.5, help="AHA gate threshold (default 0.5)")
    p.add_argument("--lam", type=_nonnegative_float, default=3e-4, help="AHA lambda of L_reg (default 3e-4)")
    p.add_argument("--d-down", type=_positive, default=None, help="DAR bottleneck width (required with dar)")


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


def _mechanism(args):
    """The AHAConfig or DARConfig the conversion flags ask for."""
    from .config import AHAConfig, ConfigError, DARConfig

    if args.mechanism == "aha":
        if args.d_down is not None:
            raise ConfigError("--d-down is a DAR setting: use it with --mechanism dar")
        return AHAConfig(window=args.window, tau=args.tau, lam=args.lam)
    if args.d_down is None:
        raise ConfigError("--mechanism dar needs --d-down (the bottleneck width, e.g. hidden size / 4)")
    return DARConfig(window=args.window, d_down=args.d_down)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            _check_demo_flags(args)
        if args.command == "demo" and args.mechanism == "dar":
            from .dar_demo import render, run_dar_demo

            report = run_dar_demo(out=args.out, preset=args.preset, data_path=args.data, device=args.device,
                                  progress=not args.no_progress, from_scratch=args.from_scratch,
                                  **({"windows": args.windows} if args.windows else {}))
            print(render(report))
            print(f"Report written to {args.out}/dar_report.md and dar_report.json")
        elif args.command == "demo":
            from .analysis.report import render_markdown
            from .demo import run_demo

            report = run_demo(out=args.out, preset=args.preset, tasks=tuple(args.tasks or ("stdlib", "recall")),
                              data_path=args.data, device=args.device, progress=not args.no_progress,
                              window=args.window, lam=args.lam, pretrain_steps=args.pretrain_steps,
                              finetune_steps=args.finetune_steps)
            print(render_markdown(report))
            print(f"Report written to {args.out}/report.md, report.json and mu_f_heatmap.png")
        elif args.command == "analyze":
            from .analysis.analyze import analyze_run, render

            results = analyze_run(args.run, tuple(args.tasks or ("stdlib", "recall")), args.target_mu)
            print(render(results))
            print(f"Written to {args.run}/analysis/: analysis.md, analysis.json, sorted_usage.png, tokens_*.html")
        elif args.command == "sweep":
            from .analysis.sweep import render, run_sweep

            res = run_sweep(args.out, args.preset, tuple(args.windows), tuple(args.lams), args.lam_window,
                            tuple(args.tasks or ("stdlib", "recall")), args.data, args.device, not args.no_progress)
            print(render(res))
            print(f"Written to {args.out}/: sweep.md, sweep.json, mu_f_vs_window.png")
        elif args.command == "perplexity":
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
        elif args.command == "eval":
            from .eval.harness import evaluate

            results = evaluate(args.model, args.tasks.split(","), args.include_path, args.limit, args.device,
                               args.num_fewshot)
            for task, metrics in results.items():
                shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                                  if isinstance(v, float) and "stderr" not in k)
                print(f"{task}: {shown}")
        elif args.command == "bench":
            from .bench.gpu import BenchConfig, render, run_bench, write_report

            if args.device is None:
                args.device = _device("auto")
                if args.device == "cpu":
                    raise ConfigError("allhere bench measures the GPU kernels and found no CUDA device; pass "
                                      "--device cpu for a smoke run of the script (its numbers are not the goals)")
            given = {"prefill_lengths": args.lengths, "decode_lengths": args.decode_lengths,
                     "train_length": args.train_length}
            cfg = BenchConfig(device=args.device, heads=args.heads, dim=args.dim, window=args.window,
                              repeats=args.repeats, **{k: (tuple(v) if isinstance(v, list) else v)
                                                       for k, v in given.items() if v is not None})
            report = run_bench(cfg)
            write_report(report, args.out)
            print(render(report))
            print(f"Written to {args.out}/bench.md and bench.json")
        elif args.command == "convert":
            from .hf import convert, convert_dar, save_pretrained
            from .hf.io import load_local

            mech = _mechanism(args)
            tokenizer, model = load_local(args.model)
            (convert if args.mechanism == "aha" else convert_dar)(model, mech)
            save_pretrained(model, args.out)
            tokenizer.save_pretrained(args.out)
            print(f"{args.mechanism.upper()} model ({mech}) saved to {args.out}; load it with allhere.hf.load_pretrained")
        elif args.command == "sft":
            from .hf import sft

            mech = _mechanism(args)
            state = sft(args.model, args.data, args.out, window=args.window, seq_len=args.seq_len,
                        batch_size=args.batch_size, global_batch=args.global_batch, epochs=args.epochs,
                        lr=args.lr, lam=args.lam, tau=args.tau, max_steps=args.max_steps, device=args.device,
                        resume=args.resume, progress=not args.no_progress,
                        d_down=getattr(mech, "d_down", None), stage1_lr=args.stage1_lr)
            last = state["history"][-1]
            mu = f", mu_f {last['mu_f']:.3f}" if last.get("mu_f") is not None else ""
            print(f"{state['step']} steps; last step: loss {last['lm']:.4f}{mu}. Model saved to {args.out}/model")
    except (ConfigError, DataError, CheckpointError, ImportError) as e:
        print(f"allhere {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
