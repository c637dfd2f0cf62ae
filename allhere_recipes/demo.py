"""``allhere demo``: start from a pretrained full-attention model, swap in AHA, fine-tune, evaluate, report
(the AHA paper, "Learning When Not to Attend Globally", Sections 3.1-3.2).

For each task (the stdlib corpus, or the user's text; and the synthetic recall task):
  1. take the pretrained full-attention decoder: the base shipped with allhere for the ``cpu`` preset
     (``allhere_recipes.bases``), or one pretrained in the run directory (``--pretrain``, the other
     presets, the user's text, other pretraining steps);
  2. copy it into an AHA model whose routers start fully global (the copy computes what the pretrained
     model computed);
  3. fine-tune with L_LM + lambda * L_reg (and, on stdlib, the full model for as many steps: the control);
  4. evaluate on held-out data: the pretrained full model, the fine-tuned AHA model and the pretrained
     model run with sliding-window attention only at the same window;
  5. write report.md, report.json and mu_f_heatmap.png into the run directory.
Interrupted runs continue from their last checkpoint when the demo is started again with the same
settings; a run directory keeps the base it started from.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from allhere.data.recall_task import RecallTask
from allhere.eval import evaluate_lm
from allhere.mechanisms import FullConfig, SlidingConfig
from allhere.model import swap_mechanism
from allhere.routing import routed_layers
from allhere.runtime.reporting import report_heldout
from allhere.runtime.runlock import run_lock

from .bases import Base, choose_base, describe
from .job import Job, step_cost
from .plans import TASKS, plan_to_dict, plans, preset_plans
from .report import goal_lines, percent, write_report
from .tasks import Task, finetune, start_task

CONTROL = "full-finetuned"  # the control's folder


def lm_task(task: Task, progress: bool) -> dict:
    """The stdlib task: full, AHA, sliding window and a full model fine-tuned as long (the control)."""
    plan, data, full = task.plan, task.data, task.full
    aha, aha_curve = finetune(task, task.run / "aha" / "checkpoint.safetensors", plan.aha, progress)
    # Control: the full model trained for the same extra steps, so that the gain of plain extra training
    # is not credited to AHA.
    control, _ = finetune(task, task.run / CONTROL / "checkpoint.safetensors", FullConfig(), progress,
                          periodic=False)
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
    heldout_events(task, {"aha": (aha, aha_row), CONTROL: (control, control_row)})
    goals = {
        "AHA keeps >= 99% of the full model's held-out quality (loss ratio)": aha_row["retain_percent"] >= 99.0,
        "AHA keeps >= 99% of the control's held-out quality (loss ratio)": aha_row["retain_vs_control_percent"] >= 99.0,
        "AHA uses full attention on <= 25% of (token, head) pairs": aha_row["mu_f"] <= 0.25,
        "sliding-window-only keeps less than AHA": slide_row["retain_percent"] < aha_row["retain_percent"],
    }
    return {"data": data.description, "seq_len": plan.seq_len, "eval_sequences": plan.eval_sequences,
            "rows": rows, "goals": goals, "aha_layers": [i for i, _ in routed_layers(aha)],
            "curves": {"pretrain": task.pretrain_curve, "aha": aha_curve}}


def recall_task(task: Task, progress: bool) -> dict:
    """The recall task: full, AHA and sliding window; AHA's usage per head on retrieval sequences."""
    plan, data, full = task.plan, task.data, task.full
    aha, aha_curve = finetune(task, task.run / "aha" / "checkpoint.safetensors", plan.aha, progress)
    sliding = swap_mechanism(full, SlidingConfig(window=plan.aha.window))
    rows = {"full (pretrained)": data.evaluate(full),
            f"AHA w={plan.aha.window} (fine-tuned)": data.evaluate(aha),
            f"sliding w={plan.aha.window} (pretrained, no fine-tuning)": data.evaluate(sliding)}
    full_row, aha_row, slide_row = rows.values()
    recall = RecallTask(seq_len=plan.seq_len)
    aha_row["usage"] = evaluate_lm(aha, recall.batch(64, torch.Generator().manual_seed(7))[0],
                                   device=plan.pretrain.device)["usage"]
    heldout_events(task, {"aha": (aha, aha_row)})
    goals = {
        "full attention reaches >= 90% accuracy": full_row["accuracy"] >= 0.90,
        "sliding-window-only stays near chance (< 2x chance)": slide_row["accuracy"] < 2 * full_row["chance"],
        "AHA within 3 points of full attention": aha_row["accuracy"] >= full_row["accuracy"] - 0.03,
        "AHA mu_f on other tokens <= 1/3 of mu_f on retrieval tokens":
            aha_row["mu_f_other"] <= aha_row["mu_f_retrieval"] / 3,
    }
    return {"data": data.description, "rows": rows, "goals": goals,
            "aha_layers": [i for i, _ in routed_layers(aha)],
            "curves": {"pretrain": task.pretrain_curve, "aha": aha_curve}}


def heldout_events(task: Task, runs: dict) -> None:
    """Each fine-tuning run's held-out row of the report (run folder -> (model, row)) in its TensorBoard events at
    its last step, with AHA's mu_f heatmap (``allhere.runtime.reporting.report_heldout``): the numbers the report
    shows."""
    for folder, (model, row) in runs.items():
        report_heldout(task.run / folder / "checkpoint.safetensors", task.plan.finetune.steps, row, model)


def run_demo(out: str | Path = "runs/demo", preset: str = "cpu", tasks: tuple[str, ...] = TASKS,
             data_path: str | None = None, device: str = "cpu", progress: bool = True, pretrain: bool = False,
             log=print, **overrides) -> dict:
    """Run (or resume) the demo in ``out``; write its report there; return it. Each task starts from its
    shipped base where there is one (``bases.choose_base``; ``pretrain``: pretrain it here instead), said
    in a line to ``log``. ``overrides``: window, lam, pretrain_steps, finetune_steps, compile (see
    ``plans.plans``)."""
    task_plans, defaults = plans(preset, device, **overrides), preset_plans(preset, device)
    report = {"preset": preset, "device": device, "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              "tasks": {}}
    t0 = time.time()
    with run_lock(out):  # one writer at a time
        bases, lines = {}, {}  # every base checked before any task starts
        for name in tasks:
            bases[name], lines[name] = choose_base(Path(out) / name, name, preset, data_path, task_plans[name],
                                                   defaults[name], pretrain)
        job = plan_job(out, {name: task_plans[name] for name in tasks}, bases, progress)
        for name in tasks:  # each task's base said once its data and folder are good (else one error only)
            task = start_task(out, name, task_plans[name], data_path, job.bar, bases[name],
                              claimed=lambda line=lines[name]: log(line))
            res = lm_task(task, job.bar) if name == "stdlib" else recall_task(task, job.bar)
            res["plan"] = plan_to_dict(task.plan)
            res["base"] = task.base
            report["tasks"][name] = res
        report["seconds"] = round(time.time() - t0, 1)
        report["run_seconds"] = job.seconds  # the training runs of this call
        write_demo_report(report, out)
    return report


def plan_job(out: str | Path, task_plans: dict, bases: dict, progress: bool) -> Job:
    """The training runs the demo will do, for the whole job's time left."""
    job = Job(progress)
    for name, plan in task_plans.items():
        pre = step_cost(plan.model, plan.pretrain.batch_size, plan.seq_len)
        ft = step_cost(plan.model, plan.finetune.batch_size, plan.seq_len)
        runs = {"aha": (plan.finetune.steps, ft)}
        if not isinstance(bases[name], Base):
            runs["pretrain"] = (plan.pretrain.steps, pre)
        if name == "stdlib":
            runs[CONTROL] = (plan.finetune.steps, ft)
        for folder, (steps, cost) in runs.items():
            job.plan(Path(out) / name / folder / "checkpoint.safetensors", steps, cost)
    return job


def lm_table(res: dict) -> list[str]:
    lines = ["| model | held-out bits/byte | Retain % | mu_f |", "|---|---|---|---|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r['bits_per_token']:.4f} | {r['retain_percent']:.1f}% | {percent(r['mu_f'])} |")
    return lines


def recall_table(res: dict) -> list[str]:
    lines = ["| model | accuracy | mu_f retrieval tokens | mu_f other tokens | mu_f all |", "|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {percent(r['accuracy'])} | {percent(r['mu_f_retrieval'])} "
                     f"| {percent(r['mu_f_other'])} | {percent(r['mu_f'])} |")
    chance = next(iter(res["rows"].values()))["chance"]
    lines.append(f"\nChance accuracy: {percent(chance)}.")
    return lines


def render(report: dict) -> str:
    """The demo's report.md: per task its table and goals."""
    out = ["# allhere demo report", "",
           f"Preset `{report['preset']}` on `{report['device']}` (CPU capability {report.get('cpu_capability')}, "
           f"{report.get('threads')} threads), torch {report['torch']}, {report['seconds']:.0f} s in all"
           + (f" ({times})." if (times := run_times(report)) else "."), ""]
    for name, res in report["tasks"].items():
        out += [f"## {name}", "", f"Base: {describe(res.get('base'), res['plan']['pretrain']['steps'])}.", "",
                f"Data: {res['data']}", ""]
        out += lm_table(res) if name == "stdlib" else recall_table(res)
        aha = next((r for r in res["rows"].values() if "retain_vs_control_percent" in r), None)
        if aha is not None:
            out += ["", f"Against the control trained for as many steps, AHA keeps "
                        f"{aha['retain_vs_control_percent']:.1f}% (loss ratio)."]
        out += ["", "Goals:"] + goal_lines(res["goals"]) + [""]
    out.append("Retain % = held-out loss of the pretrained full model / loss of the row (higher is better); "
               "mu_f = share of (token, head) pairs on full attention (the AHA paper's Eq. 8).")
    return "\n".join(out) + "\n"


def run_times(report: dict) -> str:
    """Where the time went: "stdlib/aha 128 s, ..., the rest 12 s" (the runs trained by this call)."""
    runs = report.get("run_seconds") or {}
    trained = {k: v for k, v in runs.items() if v >= 1}
    if not trained:
        return ""
    rest = report["seconds"] - sum(runs.values())
    return ", ".join(f"{k} {v:.0f} s" for k, v in trained.items()) + f", evaluations and the rest {rest:.0f} s"


def write_demo_report(report: dict, out: str | Path) -> dict[str, Path]:
    """report.json, report.md and (where a row holds usage per head) mu_f_heatmap.png in ``out``."""
    paths = write_report(out, "report", report, render(report))
    panels, layers = {}, {}
    for name, res in report["tasks"].items():
        for row_name, r in res["rows"].items():
            if "usage" in r:
                title = f"{name}: {row_name}"
                panels[title], layers[title] = r["usage"], res["aha_layers"]
    if panels:
        from allhere.analysis.plots import usage_heatmaps

        paths["png"] = usage_heatmaps(panels, Path(out) / "mu_f_heatmap.png", layers)
    return paths
