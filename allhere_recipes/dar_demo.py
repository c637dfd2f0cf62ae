"""``allhere demo --mechanism dar``: DAR against vanilla and uniform reduction on the embedded corpus
(the DAR paper, "Dual Dimensionality for Local and Global Attention", Tables 1 and 3, at small scale).

From the demo's pretrained full model (reused when the run directory holds it): convert to DAR(w, d/4)
for several windows and to uniform reduction (every token through the bottleneck, w = 0), fine-tune each
in the paper's two stages (1: only W_down / W_up; 2: everything), train a vanilla control for the same
stage-2 steps, and compare perplexity with rolling windows over held-out files (Rel. % = model
perplexity / vanilla perplexity, smaller is better, as in the DAR paper). Writes dar_report.md and
dar_report.json.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from allhere.config import TrainConfig
from allhere.eval.perplexity import rolling_perplexity
from allhere.mechanisms import DARConfig, FullConfig
from allhere.runtime.runlock import run_lock

from .plans import plans
from .report import goal_lines, write_report
from .tasks import finetune, pretrain, start_task

DEFAULT_WINDOWS = (1, 4, 16, 32, 64, 128)
STAGE_STEPS = {"tiny": 2, "cpu": 150, "gpu": 500}  # steps of each stage, per preset
MAX_DOCS = {"tiny": 2, "cpu": 10, "gpu": 100}  # held-out documents scored, per preset


def stage_configs(preset_finetune: TrainConfig, steps: int) -> tuple[TrainConfig, TrainConfig]:
    """Stage 1 trains only the bottleneck at the pretraining-scale lr; stage 2 everything at a 10x lower
    lr (the paper uses 3e-4 then 3e-5 on an LLM)."""
    s1 = dataclasses.replace(preset_finetune, steps=steps, lr=2e-3, router_lr_mult=1.0)
    s2 = dataclasses.replace(preset_finetune, steps=steps, lr=2e-4, router_lr_mult=1.0)
    return s1, s2


def run_dar_demo(out: str | Path = "runs/demo", preset: str = "cpu", windows=DEFAULT_WINDOWS, data_path=None,
                 device: str = "cpu", progress: bool = True, stage_steps: int | None = None,
                 max_docs: int | None = None, from_scratch: bool = False) -> dict:
    """The conversion comparison; with ``from_scratch`` also DAR(w=32, d/4) and uniform reduction trained
    from random weights with exactly the pretraining budget of the vanilla model (same data, steps, seed)."""
    t0 = time.time()
    with run_lock(out):  # one writer at a time
        task = start_task(out, "stdlib", plans(preset, device)["stdlib"], data_path, progress)
        plan, run = task.plan, task.run
        steps = stage_steps or STAGE_STEPS[preset]
        s1, s2 = stage_configs(plan.finetune, steps)
        d_down = plan.model.d_model // 4
        control, _ = finetune(task, run / "dar" / "vanilla-stage2" / "checkpoint.safetensors", FullConfig(), progress,
                              cfg=s2)
        docs = task.data.docs[: max_docs or MAX_DOCS[preset]]
        min_len = max(windows)
        ppl = lambda m: rolling_perplexity(m, docs, plan.seq_len, plan.seq_len // 2, min_len=min_len,  # noqa: E731
                                           device=device)
        rows = {"vanilla (pretrained)": ppl(task.full), "vanilla (+ stage-2 steps, control)": ppl(control)}
        for w in (*windows, 0):
            mech = DARConfig(window=w, d_down=d_down)
            name = "uniform reduction d/4" if w == 0 else f"DAR w={w} d/4"
            folder = run / "dar" / f"w{w}-d{d_down}"
            stage1, _ = finetune(task, folder / "stage1.safetensors", mech, progress, cfg=s1, train_only=".mechanism.")
            stage2, _ = finetune(task, folder / "stage2.safetensors", mech, progress, base=stage1, cfg=s2)
            rows[name] = ppl(stage2)
        base = rows["vanilla (+ stage-2 steps, control)"]["perplexity"]
        relative(rows, base)
        dar_main = rows.get("DAR w=32 d/4") or rows[f"DAR w={windows[0]} d/4"]
        goals = {"DAR(d/4) within 2% of vanilla perplexity": dar_main["perplexity"] <= 1.02 * base,
                 "DAR(d/4) better than uniform reduction at d/4":
                     dar_main["perplexity"] < rows["uniform reduction d/4"]["perplexity"]}
        report = {"preset": preset, "d_down": d_down, "stage_steps": steps, "docs": len(docs), "min_len": min_len,
                  "rows": rows, "goals": goals}
        if from_scratch:
            scratch = {"vanilla": dict(rows["vanilla (pretrained)"])}
            for name, mech in (("DAR w=32 d/4", DARConfig(window=32, d_down=d_down)),
                               ("uniform reduction d/4", DARConfig(window=0, d_down=d_down))):
                # the vanilla model's initialisation seed, data and steps
                ckpt = run / "dar" / f"scratch-{mech.window}-d{d_down}" / "checkpoint.safetensors"
                model, _ = pretrain(ckpt, dataclasses.replace(plan.model, mechanism=mech), plan, task.data, progress)
                scratch[name] = ppl(model)
            relative(scratch, scratch["vanilla"]["perplexity"])
            dar, van, uni = (scratch[k]["perplexity"] for k in ("DAR w=32 d/4", "vanilla", "uniform reduction d/4"))
            goals["from scratch, same budget: DAR(d/4) within 2% of vanilla perplexity"] = dar <= 1.02 * van
            goals["from scratch, same budget: DAR(d/4) better than uniform reduction at d/4"] = dar < uni
            report.update(scratch_rows=scratch, scratch_steps=plan.pretrain.steps)
        report["seconds"] = round(time.time() - t0, 1)
        write_report(out, "dar_report", report, render(report))
    return report


def relative(rows: dict, base: float) -> None:
    """The DAR paper's Rel.: each row's perplexity relative to ``base``, in percent (smaller is better)."""
    for r in rows.values():
        r["rel_percent"] = 100.0 * r["perplexity"] / base


def perplexity_table(rows: dict, rel_header: str) -> list[str]:
    out = [f"| model | perplexity | bits/byte | {rel_header} |", "|---|---|---|---|"]
    return out + [f"| {name} | {r['perplexity']:.4f} | {r['bits_per_token']:.4f} | {r['rel_percent']:.1f}% |"
                  for name, r in rows.items()]


def render(report: dict) -> str:
    """dar_report.md: the conversion table, the from-scratch table where run, and the goals."""
    out = ["# DAR against vanilla and uniform reduction", "",
           f"Rolling-window perplexity over {report['docs']} held-out documents (documents shorter than "
           f"{report['min_len']} skipped); d_down = {report['d_down']} (d/4); each DAR model fine-tuned "
           f"{report['stage_steps']} steps in stage 1 (bottleneck only) and {report['stage_steps']} in stage 2.", ""]
    out += perplexity_table(report["rows"], "Rel. % (model / control, smaller is better)")
    if "scratch_rows" in report:
        out += ["", f"From scratch, the same {report['scratch_steps']} pretraining steps, data and seed for all:", ""]
        out += perplexity_table(report["scratch_rows"], "Rel. % (model / vanilla)")
    out += ["", "Goals:"] + goal_lines(report["goals"])
    out.append(f"\n{report['seconds']:.0f} s.")
    return "\n".join(out) + "\n"
