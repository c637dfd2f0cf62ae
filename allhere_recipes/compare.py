"""``allhere compare``: the sparse patterns and AHA at (about) the same number of attention scores,
fine-tuned from the same pretrained full-attention model on the demo's tasks, quality against scores.

The run folder is the demo's (default ``runs/demo``): the tasks are claimed with the same settings, so
the demo's pretrained models are reused (and a model pretrained here is reused by a later demo). Each
mechanism is swapped into a copy of the pretrained model and fine-tuned for the same steps on the same
batches; the control is full attention fine-tuned as long. The budget is the task's AHA window w: every
local pattern is sized to read about w keys per query --

- sliding: the w most recent keys;
- sinks: w - s most recent keys + s = w / 8 sinks (StreamingLLM, arXiv:2309.17453);
- dilated: w keys at stride 1, 2, 4, 8 by layer (the reach of a Longformer-style schedule, arXiv:2004.05150);
- Longformer: w - g most recent keys + the first g = w / 8 tokens global (arXiv:2004.05150);
- BigBird: blocks of b = w / 4: 2 window blocks, 1 global block, 1 random block per query block
  (about 3.5 b = 0.9 w keys; arXiv:2007.14062);
- AHA: window w plus the full prefix where its router says so (its scores are measured, not set).

Scores per query are counted from what each model reads at the task's sequence length: the masks of the
patterns, the routers' gates of AHA on held-out sequences.

Seeds (default 0 1 2). The pretrained full-attention model is the demo's, one for every seed. A seed k
changes the fine-tuning only: the ``TrainConfig.seed`` of the fine-tuning config, which draws every step's
batches (``allhere.train.step_generator``: which windows of the training text, which generated recall
sequences), and BigBird's random blocks (``bigbird_schedule``'s seed). Nothing else is random: the models
have no dropout, the weights a mechanism adds start the same for every seed (AHA's router: W = 0, bias
+3; the patterns add none) and the held-out evaluations are fixed. Each (seed, mechanism) is a resumable
run of its own, ``<out>/<task>/compare/steps<N>/seed<k>/<mechanism>``; a finished one is reused, so a later
call with more seeds trains only the new ones. The report gives every number as its per-seed values, their
mean and sample standard deviation (None with one seed); "kept vs full" is computed per seed against that
seed's full control, then aggregated.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from allhere.masks import causal, dense_mask, sliding_window
from allhere.mechanisms import (
    FullConfig,
    LongformerConfig,
    SinksConfig,
    SlidingConfig,
    bigbird_schedule,
    dilation_schedule,
)
from allhere.runtime.reporting import report_heldout
from allhere.runtime.runlock import run_lock
from allhere.validation import check_int

from .aamoe_grid import check_seeds, stat
from .aamoe_render import ms, pct
from .plans import TASKS, plans
from .report import write_report
from .tasks import Task, finetune, start_task

DILATIONS = (1, 2, 4, 8)


def candidates(plan, n_layers: int, seed: int = 0) -> dict:
    """label -> the mechanism (one config, or one per layer) at the budget of ``plan``'s AHA window;
    ``seed``: the seed of BigBird's random blocks."""
    w = plan.aha.window
    g = max(1, w // 8)
    b = max(1, w // 4)
    return {
        "full (control)": FullConfig(),
        f"sliding w={w}": SlidingConfig(window=w),
        f"sinks w={w - g}+{g}": SinksConfig(window=w - g, n_sinks=g),
        f"dilated w={w}, d={','.join(map(str, DILATIONS[:n_layers]))} by layer":
            dilation_schedule(w, [DILATIONS[i % len(DILATIONS)] for i in range(n_layers)]),
        f"Longformer w={w - g}, {g} global": LongformerConfig(window=w - g, global_first=g),
        f"BigBird b={b}: 2 win, 1 glob, 1 rand": bigbird_schedule(n_layers, block=b, window_blocks=2, global_blocks=1,
                                                                   random_blocks=1, seed=seed),
        f"AHA w={w}": plan.aha,
    }


def _predicate(mech, n: int, layer: int):
    if isinstance(mech, FullConfig):
        return causal
    if isinstance(mech, SlidingConfig):
        return sliding_window(mech.window)
    return mech.mask_fn(n, layer)


@torch.no_grad()
def scores_per_query(model, mechanisms, n: int, heads: int, heldout: list) -> float:
    """Keys read per query, averaged over layers, heads and the n positions: from the masks, or for a
    routed layer from its gates on the held-out batches (global: the whole prefix; local: the window)."""
    layers = list(mechanisms) if isinstance(mechanisms, (list, tuple)) else [mechanisms] * len(model.blocks)
    pos = torch.arange(n, dtype=torch.float64)
    per_layer = []
    routing = model.eval()(heldout[0][:, :n]).routing if any(getattr(m, "kind", "") == "aha" for m in layers) else None
    for i, mech in enumerate(layers):
        if getattr(mech, "kind", "") == "aha":
            gates = routing.per_layer[routing.layers.index(i)].gates.double()  # [b, h, n]
            local = torch.clamp(pos + 1, max=mech.window)
            per_layer.append((gates * (pos + 1) + (1 - gates) * local).mean().item())
        else:
            per_layer.append(dense_mask(_predicate(mech, n, i), n, n, heads=heads).double().sum(-1).mean().item())
    return sum(per_layer) / len(per_layer)


def compare_seed(task: Task, steps: int, seed: int, progress: bool) -> dict:
    """label -> the evaluation of every candidate fine-tuned for ``steps`` with ``seed`` from the task's
    pretrained model, its keys read per query, and both against this seed's full control."""
    plan, data = task.plan, task.data
    cfg = dataclasses.replace(plan.finetune, steps=steps, ckpt_every=min(plan.finetune.ckpt_every, steps),
                              eval_every=0, seed=seed)
    rows, ran = {}, {}
    for label, mech in candidates(plan, plan.model.n_layers, seed).items():
        folder = task.run / "compare" / f"steps{steps}" / f"seed{seed}" / label.split()[0].lower()
        model, _ = finetune(task, folder / "checkpoint.safetensors", mech, progress, cfg=cfg, periodic=False)
        ev = data.evaluate(model)
        row = {k: v for k, v in ev.items() if k != "usage"}
        row["scores_per_query"] = scores_per_query(model, mech, plan.seq_len, plan.model.n_heads, data.heldout)
        rows[label], ran[label] = row, (folder, model, ev.get("usage"))
    full_scores = rows["full (control)"]["scores_per_query"]
    base = rows["full (control)"][data.metric]
    for label, row in rows.items():
        row["density"] = row["scores_per_query"] / full_scores
        row["retain_percent"] = 100.0 * (row[data.metric] / base if data.higher_is_better else base / row[data.metric])
        folder, model, usage = ran[label]  # the row in the run's events, beside its curves
        report_heldout(folder / "checkpoint.safetensors", steps, {**row, "usage": usage}, model)
    return rows


def over_seeds(rows: list[dict]) -> dict:
    """One mechanism's rows, one per seed -> every number as its per-seed values and their ``stat``."""
    return {k: {"values": [r[k] for r in rows], **stat(r[k] for r in rows)} for k, v in rows[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def compare_task(task: Task, steps: int, seeds, progress: bool) -> dict:
    """Fine-tune and evaluate every candidate for ``steps`` with every seed; aggregate over the seeds."""
    plan, data = task.plan, task.data
    by_seed = [compare_seed(task, steps, seed, progress) for seed in seeds]
    rows = {label: over_seeds([seed_rows[label] for seed_rows in by_seed]) for label in by_seed[0]}
    return {"data": data.description, "metric": data.metric, "higher_is_better": data.higher_is_better,
            "seq_len": plan.seq_len, "window": plan.aha.window, "steps": steps, "seeds": list(seeds), "rows": rows}


def run_compare(out: str | Path = "runs/demo", preset: str = "cpu", tasks=TASKS, steps: int = 100,
                data_path: str | None = None, device: str = "cpu", progress: bool = True, seeds=(0, 1, 2)) -> dict:
    """Run (or resume) the comparison with every seed of ``seeds`` in the demo's run folder ``out``; write
    compare.md, compare.json and compare.png into ``out/compare``; return the report."""
    check_int("compare", "steps", steps, 1)
    seeds = check_seeds(seeds)
    t0 = time.time()
    task_plans = plans(preset, device)
    report = {"preset": preset, "device": device, "torch": torch.__version__, "seeds": list(seeds), "tasks": {}}
    with run_lock(out):  # one writer at a time (the demo's folder: not while a demo runs there)
        for name in tasks:
            task = start_task(out, name, task_plans[name], data_path, progress)
            report["tasks"][name] = compare_task(task, steps, seeds, progress)
        report["seconds"] = round(time.time() - t0, 1)
        folder = Path(out) / "compare"
        from .compare_plot import plot_compare

        plot_compare(report, folder / "compare.png")
        write_report(folder, "compare", report, render(report))
    return report


def render(report: dict) -> str:
    seeds = ", ".join(map(str, report["seeds"]))
    lines = ["# Sparse patterns and AHA at the same attention budget", "",
             f"Preset {report['preset']}, device {report['device']}, torch {report['torch']}, "
             f"{report.get('seconds', 0) / 60:.1f} min. Every model: the task's pretrained full-attention model "
             "with the mechanism swapped in, fine-tuned for the same steps on the same batches as the others of its "
             "seed.", "",
             f"Seeds: {seeds}. A seed draws the fine-tuning batches and BigBird's random blocks; the pretrained "
             "model is one for all seeds. Every number is the mean ± the sample standard deviation over the seeds "
             "(one number: one seed); \"kept\" is taken per seed against that seed's full control.", ""]
    for name, t in report["tasks"].items():
        better = "higher" if t["higher_is_better"] else "lower"
        lines += [f"## {name}", "", f"{t['data']}; sequence length {t['seq_len']}, budget w = {t['window']} keys per "
                  f"query, {t['steps']} fine-tuning steps. {t['metric']}: {better} is better.", "",
                  f"| mechanism | seeds | keys read per query | of full | {t['metric']} | kept vs full (control) |",
                  "|---|---|---|---|---|---|"]
        for label, r in sorted(t["rows"].items(), key=lambda kv: -kv[1]["scores_per_query"]["mean"]):
            lines.append(f"| {label} | {r['scores_per_query']['n']} | {ms(r['scores_per_query'], 1)} | "
                         f"{pct(r['density'])} | {ms(r[t['metric']])} | {ms(r['retain_percent'], 1)}% |")
        lines.append("")
    lines.append("![quality against scores](compare.png)")
    return "\n".join(lines) + "\n"
