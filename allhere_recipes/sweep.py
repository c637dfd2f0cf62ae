"""``allhere sweep``: window and lambda sweeps in the form of the AHA paper's ("Learning When Not to
Attend Globally") Tables 1, 2 and 4: one pretrained full model per task, one AHA fine-tune per
(window, lambda), quality, Retain % and mu_f per task and on average.

Resumable: every fine-tune keeps its checkpoint and its ``result.json`` in its own folder; a second
call reuses what is finished. Windows not shorter than a task's sequence length are skipped for that
task (AHA would have nothing to decide).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from allhere.runtime.reporting import report_heldout
from allhere.runtime.runlock import run_lock

from .plans import TASKS, plans
from .report import percent, write_report
from .rundir import write_json
from .tasks import finetune, start_task

DEFAULT_WINDOWS = (16, 32, 64, 128, 256)
DEFAULT_LAMS = (1e-4, 3e-4, 1e-3)


def retain(metric: str, base: float, value: float) -> float:
    """Quality kept, in percent: loss ratio for losses, accuracy ratio for accuracies."""
    return 100.0 * (base / value if metric != "accuracy" else value / base)


def run_sweep(out: str | Path = "runs/sweep", preset: str = "cpu", windows=DEFAULT_WINDOWS, lams=DEFAULT_LAMS,
              lam_window: int | None = None, tasks=TASKS, data_path: str | None = None,
              device: str = "cpu", progress: bool = True) -> dict:
    """Run (or resume) the sweeps in ``out``; write sweep.md, sweep.json and mu_f_vs_window.png there.
    ``lam_window``: the window of the lambda sweep (default the preset's)."""
    out = Path(out)
    with run_lock(out):  # one writer at a time
        results = {"preset": preset, "windows": list(windows), "lams": list(lams), "tasks": {}}
        for name in tasks:
            task = start_task(out, name, plans(preset, device)[name], data_path, progress)
            plan, data = task.plan, task.data
            base = data.evaluate(task.full)[data.metric]
            w_lam = lam_window or plan.aha.window
            configs = [("window", w, plan.aha.lam) for w in windows] + [("lambda", w_lam, lam) for lam in lams]
            rows = []
            for kind, w, lam in configs:
                if w >= plan.seq_len:
                    rows.append({"sweep": kind, "window": w, "lam": lam,
                                 "skipped": f"window >= seq_len {plan.seq_len}"})
                    continue
                folder = task.run / f"w{w}-lam{lam:g}"
                done = folder / "result.json"
                if done.exists():
                    r = json.loads(done.read_text())
                else:
                    mech = dataclasses.replace(plan.aha, window=w, lam=lam)
                    model, _ = finetune(task, folder / "checkpoint.safetensors", mech, progress)
                    ev = data.evaluate(model)
                    r = {"window": w, "lam": lam, data.metric: ev[data.metric], "mu_f": ev["mu_f"],
                         "retain_percent": retain(data.metric, base, ev[data.metric])}
                    numbers = {k: v for k, v in r.items() if k not in ("window", "lam")}
                    report_heldout(folder / "checkpoint.safetensors", plan.finetune.steps,  # beside its curves
                                   {**numbers, "usage": ev.get("usage")}, model)
                    write_json(done, r, indent=None)
                rows.append({"sweep": kind, **r})
            results["tasks"][name] = {"metric": data.metric, "full": base, "seq_len": plan.seq_len, "rows": rows,
                                      "finetune_steps": plan.finetune.steps, "lam_window": w_lam,
                                      "default_lam": plan.aha.lam}
        write_report(out, "sweep", results, render(results))
        plot(results, out / "mu_f_vs_window.png")
    return results


def _cell(rows, kind, key, value, field, fmt):
    r = next((r for r in rows if r["sweep"] == kind and r[key] == value), None)
    if r is None or "skipped" in r:
        return "n/a"
    return fmt(r[field])


def render(results: dict) -> str:
    """sweep.md: the window sweep and the lambda sweep, one table each."""
    tasks = results["tasks"]
    names = list(tasks)
    out = ["# AHA sweeps", "", "Quality per task (" + ", ".join(f"{n}: {tasks[n]['metric']}" for n in names)
           + "), Retain % against the pretrained full model, and mu_f.", ""]

    def table(kind, key, values, label):
        head = [label] + [f"{n} {tasks[n]['metric']}" for n in names] + ["Retain % (avg)"]
        head += [f"mu_f {n}" for n in names] + ["mu_f avg"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines.append("| full attention | " + " | ".join(f"{tasks[n]['full']:.4f}" for n in names) + " | 100.0% | "
                     + " | ".join("100.0%" for _ in names) + " | 100.0% |")
        for v in values:
            rows = {n: tasks[n]["rows"] for n in names}
            quality = [_cell(rows[n], kind, key, v, tasks[n]["metric"], lambda x: f"{x:.4f}") for n in names]
            kept = [r for n in names for r in rows[n] if r["sweep"] == kind and r[key] == v and "skipped" not in r]
            kept_avg = f"{sum(r['retain_percent'] for r in kept) / len(kept):.1f}%" if kept else "n/a"
            mus = [_cell(rows[n], kind, key, v, "mu_f", percent) for n in names]
            avg = percent(sum(r["mu_f"] for r in kept) / len(kept)) if kept else "n/a"
            lines.append(f"| {label} = {v:g} | " + " | ".join(quality) + f" | {kept_avg} | " + " | ".join(mus)
                         + f" | {avg} |")
        return lines

    lams = {tasks[n]["default_lam"] for n in names}
    out += [f"## Window sweep (Tables 1 and 2; lambda = {', '.join(f'{x:g}' for x in sorted(lams))})", ""]
    out += table("window", "window", results["windows"], "w") + [""]
    wins = {tasks[n]["lam_window"] for n in names}
    out += [f"## Lambda sweep (Table 4; w = {', '.join(str(x) for x in sorted(wins))})", ""]
    out += table("lambda", "lam", results["lams"], "lambda") + [""]
    out.append("n/a: window not shorter than the task's sequence length. Every AHA row is fine-tuned for "
               + ", ".join(f"{tasks[n]['finetune_steps']} steps ({n})" for n in names) + ".")
    return "\n".join(out) + "\n"


def plot(results: dict, path: Path) -> None:
    """mu_f against the window, one line per task (log2 x axis)."""
    from allhere.analysis.plots import require_matplotlib

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, t in results["tasks"].items():
        pts = [(r["window"], r["mu_f"]) for r in t["rows"] if r["sweep"] == "window" and "skipped" not in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window w")
    ax.set_ylabel("mu_f (share on full attention)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
