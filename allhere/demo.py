"""The main job: pretrain a full-attention model, swap in AHA, fine-tune, evaluate, report (seeds/003 3.1-3.2).

For each task (the stdlib corpus, or the user's text; and the synthetic recall task):
  1. pretrain a small full-attention decoder (reused from the run directory when already finished);
  2. copy it into an AHA model whose routers start fully global (the copy computes what the pretrained
     model computed);
  3. fine-tune with L_LM + lambda * L_reg;
  4. evaluate on held-out data: the pretrained full model, the fine-tuned AHA model and the pretrained
     model run with sliding-window attention only at the same window;
  5. write report.md, report.json and mu_f_heatmap.png into the run directory.
Interrupted runs continue from their last checkpoint when the demo is started again with the same
settings.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import atomic_write
from .config import AHAConfig, ConfigError, FullConfig, ModelConfig, SlidingConfig, TrainConfig, mechanism_from_dict
from .data.corpus import VOCAB_SIZE, eval_windows, sample_batch, stdlib_corpus, text_corpus
from .data.recall import RecallTask
from .eval import evaluate_lm, evaluate_recall
from .model import Decoder, swap_mechanism
from .train import train


@dataclass(frozen=True)
class TaskPlan:
    """Everything one task of the demo needs."""

    model: ModelConfig  # the full-attention model that is pretrained
    aha: AHAConfig  # the mechanism swapped in for fine-tuning
    pretrain: TrainConfig
    finetune: TrainConfig
    seq_len: int  # tokens per training / evaluation sequence
    eval_sequences: int  # held-out sequences evaluated


def _plans(preset: str, device: str) -> dict[str, TaskPlan]:
    """Presets: "cpu" (the default, about 15 minutes on 2 CPU cores), "tiny" (seconds, for tests), "gpu"."""
    if preset == "tiny":
        lm = ModelConfig(vocab_size=VOCAB_SIZE, d_model=32, n_layers=2, n_heads=2)
        rc = ModelConfig(vocab_size=RecallTask(seq_len=48).vocab_size, d_model=32, n_layers=2, n_heads=2)
        tc = lambda steps, lr: TrainConfig(steps=steps, batch_size=4, lr=lr, ckpt_every=4, log_every=2,  # noqa: E731
                                           eval_every=2, device=device)
        return {
            "stdlib": TaskPlan(lm, AHAConfig(window=8, lam=0.01), tc(6, 3e-3), tc(4, 1e-3), 48, 4),
            "recall": TaskPlan(rc, AHAConfig(window=8, lam=0.01), tc(6, 3e-3), tc(4, 1e-3), 48, 32),
        }
    if preset not in ("cpu", "gpu"):
        raise ConfigError(f"preset = {preset!r} is invalid: expected one of 'cpu', 'tiny', 'gpu'")
    big = preset == "gpu"
    lm = ModelConfig(vocab_size=VOCAB_SIZE, d_model=512 if big else 192, n_layers=8 if big else 4,
                     n_heads=8 if big else 6)
    task = RecallTask(seq_len=96)
    rc = ModelConfig(vocab_size=task.vocab_size, d_model=128, n_layers=2, n_heads=4)
    lm_pre = TrainConfig(steps=3000 if big else 800, batch_size=32 if big else 16, lr=1e-3 if big else 2e-3,
                         ckpt_every=100, eval_every=100, device=device)
    lm_ft = TrainConfig(steps=1000 if big else 250, batch_size=lm_pre.batch_size, lr=3e-4, router_lr_mult=10.0,
                        ckpt_every=50, eval_every=50, device=device)
    rc_pre = TrainConfig(steps=400, batch_size=64, lr=2e-3, ckpt_every=100, eval_every=100, device=device)
    rc_ft = TrainConfig(steps=200, batch_size=64, lr=3e-4, router_lr_mult=10.0, ckpt_every=50, eval_every=50,
                        device=device)
    return {
        "stdlib": TaskPlan(lm, AHAConfig(window=32, lam=0.05), lm_pre, lm_ft, 1024 if big else 256, 128),
        "recall": TaskPlan(rc, AHAConfig(window=16, lam=0.05), rc_pre, rc_ft, task.seq_len, 1024),
    }


def plans(preset: str = "cpu", device: str = "cpu", window: int | None = None, lam: float | None = None,
          pretrain_steps: int | None = None, finetune_steps: int | None = None) -> dict[str, TaskPlan]:
    """The preset's plans with the command-line overrides applied (each one validated)."""
    out = {}
    for name, p in _plans(preset, device).items():
        aha = dataclasses.replace(p.aha, **{k: v for k, v in (("window", window), ("lam", lam)) if v is not None})
        pre = p.pretrain if pretrain_steps is None else dataclasses.replace(p.pretrain, steps=pretrain_steps)
        ft = p.finetune if finetune_steps is None else dataclasses.replace(p.finetune, steps=finetune_steps)
        if aha.window >= p.seq_len:
            raise ConfigError(f"window = {aha.window} must be smaller than the sequence length {p.seq_len}, "
                              "or AHA has nothing to decide")
        out[name] = dataclasses.replace(p, aha=aha, pretrain=pre, finetune=ft)
    return out


@dataclass
class TaskData:
    """A task's batches and evaluations, shared by the demo and the sweep."""

    description: str
    pretrain_batches: Callable
    finetune_batches: Callable
    evaluate: Callable[[Decoder], dict]  # held-out evaluation of a model
    periodic: Callable[[Decoder], dict]  # a cheaper one, during training
    metric: str  # the quality metric in evaluate's result
    higher_is_better: bool
    heldout: list  # held-out token batches [b, seq] (for routing statistics)
    docs: list  # held-out documents one by one (for rolling-window perplexity); empty for recall


def task_data(name: str, plan: TaskPlan, data_path: str | None = None) -> TaskData:
    dev = plan.pretrain.device
    if name == "stdlib":
        corpus = stdlib_corpus() if data_path is None else text_corpus(data_path)
        batches = lambda step, micro, g: sample_batch(corpus.train, plan.pretrain.batch_size, plan.seq_len, g)  # noqa: E731
        windows = eval_windows(corpus.val, plan.seq_len, plan.eval_sequences)
        return TaskData(corpus.describe(), batches, batches, lambda m: evaluate_lm(m, windows, device=dev),
                        lambda m: _brief(evaluate_lm(m, windows[:16], device=dev), ("loss", "mu_f")),
                        "bits_per_token", False, list(windows.split(16)), corpus.val_docs)
    task = RecallTask(seq_len=plan.seq_len)
    return TaskData(
        f"recall task {dataclasses.asdict(task)} (min distance query->pair {task.min_distance} tokens)",
        lambda step, micro, g: task.training_batch(plan.pretrain.batch_size, g, curriculum=True),
        lambda step, micro, g: task.training_batch(plan.finetune.batch_size, g),
        lambda m: evaluate_recall(m, task, plan.eval_sequences, device=dev),
        lambda m: _brief(evaluate_recall(m, task, 128, device=dev), ("accuracy", "mu_f")),
        "accuracy", True, list(task.batch(256, torch.Generator().manual_seed(99))[0].split(64)), [])


def pretrain(run: Path, plan: TaskPlan, data: TaskData, progress: bool) -> tuple[Decoder, list]:
    """The full-attention model of the task (reused from ``run/pretrain`` when finished)."""
    torch.manual_seed(plan.pretrain.seed)
    full = Decoder(plan.model)
    evals = train(full, data.pretrain_batches, plan.pretrain, run / "pretrain" / "checkpoint.safetensors",
                  resume=True, eval_fn=data.periodic, progress=progress)["evals"]
    return full, evals


def finetune(ckpt: Path, full: Decoder, mechanism, plan: TaskPlan, data: TaskData, progress: bool,
             train_only: str | None = None):
    """A copy of ``full`` with ``mechanism`` swapped in, fine-tuned (reused from ``ckpt`` when finished)."""
    model = swap_mechanism(full, mechanism)
    evals = train(model, data.finetune_batches, plan.finetune, ckpt, resume=True, eval_fn=data.periodic,
                  progress=progress, train_only=train_only)["evals"]
    return model, evals


def run_lm_task(run: Path, plan: TaskPlan, data_path: str | None, progress: bool) -> dict:
    data = task_data("stdlib", plan, data_path)
    full, pre_curve = pretrain(run, plan, data, progress)
    aha, aha_curve = finetune(run / "aha" / "checkpoint.safetensors", full, plan.aha, plan, data, progress)
    # Control: the full model trained for the same extra steps, so that the gain of plain extra training
    # is not credited to AHA.
    control = swap_mechanism(full, FullConfig())
    train(control, data.finetune_batches, plan.finetune, run / "full-finetuned" / "checkpoint.safetensors",
          resume=True, progress=progress)
    sliding = swap_mechanism(full, SlidingConfig(window=plan.aha.window))
    rows = {"full (pretrained)": data.evaluate(full),
            f"AHA w={plan.aha.window} (fine-tuned)": data.evaluate(aha),
            f"sliding w={plan.aha.window} (pretrained, no fine-tuning)": data.evaluate(sliding),
            "full (pretrained + the same fine-tuning steps, control)": data.evaluate(control)}
    base = rows["full (pretrained)"]["loss"]
    for r in rows.values():
        r["retain_percent"] = 100.0 * base / r["loss"]
    _, aha_row, slide_row, control_row = rows.values()
    aha_row["retain_vs_control_percent"] = 100.0 * control_row["loss"] / aha_row["loss"]
    goals = {
        "AHA keeps >= 99% of the full model's held-out quality (loss ratio)": aha_row["retain_percent"] >= 99.0,
        "AHA uses full attention on <= 25% of (token, head) pairs": aha_row["mu_f"] <= 0.25,
        "sliding-window-only keeps less than AHA": slide_row["retain_percent"] < aha_row["retain_percent"],
    }
    return {"data": data.description, "seq_len": plan.seq_len, "eval_sequences": plan.eval_sequences,
            "rows": rows, "goals": goals, "aha_layers": [i for i, _ in aha.aha_modules()],
            "curves": {"pretrain": pre_curve, "aha": aha_curve}}


def _brief(metrics: dict, keys: tuple[str, ...]) -> dict:
    return {k: round(metrics[k], 5) for k in keys}


def run_recall_task(run: Path, plan: TaskPlan, progress: bool) -> dict:
    data = task_data("recall", plan)
    full, pre_curve = pretrain(run, plan, data, progress)
    aha, aha_curve = finetune(run / "aha" / "checkpoint.safetensors", full, plan.aha, plan, data, progress)
    sliding = swap_mechanism(full, SlidingConfig(window=plan.aha.window))
    rows = {"full (pretrained)": data.evaluate(full),
            f"AHA w={plan.aha.window} (fine-tuned)": data.evaluate(aha),
            f"sliding w={plan.aha.window} (pretrained, no fine-tuning)": data.evaluate(sliding)}
    full_row, aha_row, slide_row = rows.values()
    task = RecallTask(seq_len=plan.seq_len)
    aha_row["usage"] = evaluate_lm(aha, task.batch(64, torch.Generator().manual_seed(7))[0],
                                   device=plan.pretrain.device)["usage"]
    goals = {
        "full attention reaches >= 90% accuracy": full_row["accuracy"] >= 0.90,
        "sliding-window-only stays near chance (< 2x chance)": slide_row["accuracy"] < 2 * full_row["chance"],
        "AHA within 3 points of full attention": aha_row["accuracy"] >= full_row["accuracy"] - 0.03,
        "AHA mu_f on other tokens <= 1/3 of mu_f on retrieval tokens":
            aha_row["mu_f_other"] <= aha_row["mu_f_retrieval"] / 3,
    }
    return {"data": data.description, "rows": rows, "goals": goals,
            "aha_layers": [i for i, _ in aha.aha_modules()], "curves": {"pretrain": pre_curve, "aha": aha_curve}}


def run_demo(out: str | Path = "runs/demo", preset: str = "cpu", tasks: tuple[str, ...] = ("stdlib", "recall"),
             data_path: str | None = None, device: str = "cpu", progress: bool = True, **overrides) -> dict:
    out = Path(out)
    task_plans = plans(preset, device, **overrides)
    report = {"preset": preset, "device": device, "torch": torch.__version__, "tasks": {}}
    t0 = time.time()
    for name in tasks:
        plan = task_plans[name]
        run = out / name
        settings = {"plan": _plan_dict(plan), "data_path": data_path}
        _check_run_settings(run, settings)
        if name == "stdlib":
            res = run_lm_task(run, plan, data_path, progress)
        else:
            res = run_recall_task(run, plan, progress)
        res["plan"] = settings["plan"]
        report["tasks"][name] = res
    report["seconds"] = round(time.time() - t0, 1)
    from .analysis.report import write_report

    write_report(report, out)
    return report


def _plan_dict(plan: TaskPlan) -> dict:
    return {"model": plan.model.to_dict(), "aha": dataclasses.asdict(plan.aha), "pretrain": plan.pretrain.to_dict(),
            "finetune": plan.finetune.to_dict(), "seq_len": plan.seq_len, "eval_sequences": plan.eval_sequences}


def plan_from_dict(d: dict) -> TaskPlan:
    """The inverse of ``_plan_dict`` (a run's settings.json back into a plan)."""
    return TaskPlan(ModelConfig.from_dict(d["model"]), mechanism_from_dict(d["aha"]), TrainConfig(**d["pretrain"]),
                    TrainConfig(**d["finetune"]), d["seq_len"], d["eval_sequences"])


def _check_run_settings(run: Path, settings: dict) -> None:
    """A run directory belongs to one set of settings: reuse it for the same, refuse it for others."""
    path = run / "settings.json"
    text = json.dumps(settings, indent=1, sort_keys=True)
    if path.exists():
        if json.loads(path.read_text()) != json.loads(text):
            raise ConfigError(f"{run} holds a run with other settings; choose another --out (nothing was changed)")
        return
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))
