"""Commands that train and report in a run folder: ``demo``, ``sweep``, ``analyze``."""

from __future__ import annotations

import argparse

from allhere_recipes.plans import PRESETS, TASKS
from allhere_recipes.real_plan import LONG as REAL_LONG

from ..runtime.reporting import report_to
from ..validation import ConfigError
from . import args as a

# demo -------------------------------------------------------------------------------------------------

def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=a.out_folder, default=None,
                   help="run folder: resumed when it holds a run with the same settings, refused when it holds "
                        "anything else (default runs/demo; with --model runs/<the model's name>)")
    p.add_argument("--model", type=a.model_or_fetchable, default=None,
                   help="run the AHA paper's protocol on a real pretrained model instead of the embedded one: "
                        "smollm2 (fetched into allhere's cache first when it is not there, as `allhere fetch "
                        "smollm2` does), a GGUF file or a transformers folder; "
                        "with --mechanism dar the DAR comparison on it (default: the embedded model)")
    a.preset_flag(p, PRESETS + (REAL_LONG,),
                  f"; {REAL_LONG}: with --model, the AHA job with twice the fine-tuning steps (about 70 min on 2 "
                  "cores against 45 for cpu; docs/real-model.md)")
    a.task_flag(p, "run", TASKS)
    a.data_flag(p)
    a.device_flag(p)
    p.add_argument("--window", type=a.positive, default=None,
                   help="AHA / sliding window w (default: the preset's; tiny 8, else 32 for stdlib and 16 for recall)")
    p.add_argument("--lam", type=a.nonnegative, default=None,
                   help="lambda of L_reg (default: the preset's; tiny 0.01, else 0.05)")
    p.add_argument("--pretrain", action="store_true",
                   help="pretrain each task's full-attention base in this run (--preset cpu: about 5 more minutes "
                        "on 2 cores) instead of starting from the base shipped with allhere (the default where "
                        "there is one: --preset cpu on the stdlib corpus with its pretraining steps; the other "
                        "presets, --data and --pretrain-steps always pretrain here)")
    p.add_argument("--pretrain-steps", type=a.positive, default=None,
                   help="optimizer steps of the full model's pretraining (default: the preset's; tiny 6, "
                        "cpu 800 for stdlib and 400 for recall, gpu 3000 and 400)")
    p.add_argument("--finetune-steps", type=a.positive, default=None,
                   help="optimizer steps of the AHA fine-tuning and its control (default: the preset's; tiny 4, "
                        "cpu 200 for stdlib and 200 for recall, gpu 1000 and 200)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every training run's forward (default off: on 2 CPU cores a step takes "
                        "~0.87x after 10-20 s of compiling per model, which the cpu preset's runs do not win back)")
    a.report_flag(p)
    a.progress_flag(p)
    p.add_argument("--mechanism", default="aha", choices=["aha", "dar"],
                   help="aha (default): the AHA demo; dar: DAR against vanilla and uniform reduction")
    p.add_argument("--windows", type=a.positive, nargs="+", default=None,
                   help="with --mechanism dar: the DAR windows to compare (default 1 4 16 32 64 128)")
    p.add_argument("--from-scratch", action="store_true",
                   help="with --mechanism dar: also train DAR and uniform reduction from scratch with the "
                        "vanilla model's pretraining budget (default: off)")
    p.add_argument("--seed", type=a.positive_or_zero, default=None,
                   help="with --model (AHA): the seed of the fine-tuning runs' batches, to repeat the job on other "
                        "draws of the same data (default 0; another seed needs another --out)")


def _check_demo_flags(args) -> None:
    """A flag of the other demo (or of the embedded model's demo, with --model) is an error, not silently
    ignored."""
    only = {"aha": {"window": "--window", "lam": "--lam", "pretrain_steps": "--pretrain-steps",
                    "finetune_steps": "--finetune-steps", "tasks": "--task", "compile": "--compile",
                    "pretrain": "--pretrain"},
            "dar": {"windows": "--windows", "from_scratch": "--from-scratch"}}
    other = "dar" if args.mechanism == "aha" else "aha"
    foreign = {**only["aha"], **only["dar"]} if args.model is not None else only[other]
    given = [flag for name, flag in foreign.items() if getattr(args, name, None) not in (None, False)]
    if args.seed is not None and (args.model is None or args.mechanism != "aha"):
        raise ConfigError("--seed is for `allhere demo --model` with the AHA job (the seed of its fine-tuning runs)")
    if args.preset == REAL_LONG and (args.model is None or args.mechanism != "aha"):
        raise ConfigError(f"--preset {REAL_LONG} is for `allhere demo --model` with the AHA job")
    if given and args.model is not None:
        raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the embedded model's demo, "
                          "not for --model (its settings: --preset, --device, --data, --out)")
    if given:
        raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
                          f"`allhere demo --mechanism {other}`, not --mechanism {args.mechanism}")


def demo(args) -> None:
    _check_demo_flags(args)
    if args.model is not None:
        return _real_demo(args)
    args.out = args.out or "runs/demo"
    if args.mechanism == "dar":
        from allhere_recipes.dar_demo import render, run_dar_demo

        with report_to(args.report_to, root=args.out):
            report = run_dar_demo(out=args.out, preset=args.preset, data_path=args.data, device=args.device,
                                  progress=not args.no_progress, from_scratch=args.from_scratch,
                                  **({"windows": args.windows} if args.windows else {}))
        print(render(report))
        print(f"Report written to {args.out}/dar_report.md and dar_report.json")
        return
    from allhere_recipes.demo import render, run_demo

    with report_to(args.report_to, root=args.out):  # each training run: <its folder>/tensorboard
        report = run_demo(out=args.out, preset=args.preset, tasks=tuple(args.tasks or TASKS), data_path=args.data,
                          device=args.device, progress=not args.no_progress, pretrain=args.pretrain,
                          window=args.window, lam=args.lam, pretrain_steps=args.pretrain_steps,
                          finetune_steps=args.finetune_steps, compile=args.compile)
    print(render(report))
    print(f"Report written to {args.out}/report.md, report.json and mu_f_heatmap.png")


def real_demo_out(model: str) -> str:
    """``runs/<name>``: a fetched model's name (``allhere fetch smollm2`` -> runs/smollm2), else the stem of the
    GGUF file or the folder's name."""
    from pathlib import Path

    from ..runtime.models_cache import KNOWN, cache_dir

    if model in KNOWN and not Path(model).exists():  # a known model's name, fetched by the job
        return f"runs/{model}"
    path = Path(model).resolve()
    if path.parent.parent == (cache_dir() / "models").resolve():
        return f"runs/{path.parent.name}"
    return f"runs/{path.stem.split('.')[0]}"


def _real_demo(args) -> None:
    out = args.out or real_demo_out(args.model)
    settings = dict(model=args.model, out=out, preset=None if args.preset == "cpu" else args.preset,
                    device=args.device, data_path=args.data, progress=not args.no_progress)
    if args.seed is not None:
        settings["seed"] = args.seed
    if args.mechanism == "dar":
        from allhere_recipes.real_dar import run_real_dar
        from allhere_recipes.real_report import render_dar

        with report_to(args.report_to, root=out):
            result = run_real_dar(**settings)
        print(render_dar(result))
        print(f"Report written to {out}/dar/dar_report.md and dar_report.json")
        return
    from allhere_recipes.real_model import run_real_demo
    from allhere_recipes.real_report import render_aha

    with report_to(args.report_to, root=out):
        result = run_real_demo(**settings)
    print(render_aha(result))
    print(f"Report written to {out}/aha/report.md, report.json and mu_f_heatmap.png")


# analyze ----------------------------------------------------------------------------------------------

def analyze_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", type=a.existing_folder, default="runs/demo",
                   help="a finished demo run folder (default runs/demo)")
    a.task_flag(p, "analyse", TASKS)
    p.add_argument("--target-mu", type=a.fraction, default=None,
                   help="also calibrate tau for this share of full attention (0 < x < 1) and report where it "
                        "lands (default: no calibration)")


def analyze(args) -> None:
    from allhere_recipes.analyze import analyze_run, render

    results = analyze_run(args.run, tuple(args.tasks or TASKS), args.target_mu)
    print(render(results))
    print(f"Written to {args.run}/analysis/: analysis.md, analysis.json, sorted_usage.png, tokens_*.html")


# sweep ------------------------------------------------------------------------------------------------

def sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=a.out_folder, default="runs/sweep",
                   help="sweep folder: resumed when it holds a sweep with the same settings, refused when it "
                        "holds anything else (default runs/sweep)")
    a.preset_flag(p, PRESETS)
    p.add_argument("--windows", type=a.positive, nargs="+", default=[16, 32, 64, 128, 256],
                   help="windows of the window sweep (default 16 32 64 128 256)")
    p.add_argument("--lams", type=a.nonnegative, nargs="+", default=[1e-4, 3e-4, 1e-3],
                   help="lambdas of the lambda sweep (default 1e-4 3e-4 1e-3)")
    p.add_argument("--lam-window", type=a.positive, default=None,
                   help="window of the lambda sweep (default: the preset's AHA window of each task)")
    a.task_flag(p, "sweep", TASKS)
    a.data_flag(p)
    a.device_flag(p)
    a.report_flag(p)
    a.progress_flag(p)


def sweep(args) -> None:
    from allhere_recipes.sweep import render, run_sweep

    with report_to(args.report_to, root=args.out):
        res = run_sweep(args.out, args.preset, tuple(args.windows), tuple(args.lams), args.lam_window,
                        tuple(args.tasks or TASKS), args.data, args.device, not args.no_progress)
    print(render(res))
    print(f"Written to {args.out}/: sweep.md, sweep.json, mu_f_vs_window.png")


# aamoe ------------------------------------------------------------------------------------------------

def aamoe_arguments(p: argparse.ArgumentParser) -> None:
    from allhere_recipes.aamoe import PRESETS as AAMOE_PRESETS
    from allhere_recipes.aamoe import TASKS as AAMOE_TASKS

    p.add_argument("--out", type=a.out_folder, default="runs/aamoe",
                   help="run folder (models in <out>/aamoe/<model>/seed<k>), resumed with the same settings; one "
                        "task per folder (default runs/aamoe)")
    p.add_argument("--preset", default="cpu", choices=tuple(AAMOE_PRESETS),
                   help="sizes and steps: cpu (default, 300 steps: minutes per run on 2 shared cores), cpu-long "
                        "(10000 steps, the runs that decide the claim; see docs/aamoe.md), tiny (seconds)")
    p.add_argument("--task", default="stdlib", choices=AAMOE_TASKS,
                   help="stdlib (default): the embedded byte corpus; mixed: table facts only parameters can hold "
                        "and pairs only the context answers, in stdlib filler (accuracy per kind of query)")
    p.add_argument("--models", type=a.text, nargs="+", default=None,
                   help="train only these models: report names or keys dense, all-attention, context-only, "
                        "experts-only, aamoe-<B>, aamoe (every budget) (default: all)")
    p.add_argument("--seeds", type=a.positive_or_zero, nargs="+", default=[0, 1, 2],
                   help="train these seeds of every chosen model (default 0 1 2); the report covers every "
                        "finished seed of the folder")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing; report on the runs of the folder that have finished (default: train "
                        "the chosen runs first)")
    a.device_flag(p, "cpu")
    p.add_argument("--steps", type=a.positive, default=None,
                   help="training steps of every model (default: the preset's; cpu 300, cpu-long 10000, tiny 3)")
    p.add_argument("--budgets", type=a.positive_number, nargs="+", default=None,
                   help="AA-MoE budgets B, resources per token (default: the preset's; cpu 1 2 4, cpu-long 2, "
                        "tiny 2)")
    a.report_flag(p)
    a.progress_flag(p)


def aamoe(args) -> None:
    from allhere_recipes.aamoe import render, run_aamoe

    with report_to(args.report_to, root=args.out):
        report = run_aamoe(args.out, args.preset, args.device, not args.no_progress, args.steps, args.budgets,
                           wanted=args.models, seeds=args.seeds, task=args.task, train_runs=not args.report_only)
    print(render(report))
    print(f"Written to {args.out}/aamoe/: report.md, report.json and plots")
