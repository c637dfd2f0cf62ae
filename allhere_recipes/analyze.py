"""``allhere analyze``: where global attention goes in a finished demo run -- statistics, figures and
the static baseline.

For each task of the run: routing statistics of the fine-tuned AHA model on the held-out data (mu_f
per layer x head, mean gap between global calls per head, the top-10% heads' share), the sorted-usage
curve, and the static baseline (the busiest heads fixed global, the rest local, same weights, a budget
at least the dynamic one) against the dynamic router. Writes analysis.md, analysis.json and figures into
``<run>/analysis``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from allhere.analysis.budget import calibrate_tau, set_tau
from allhere.analysis.html import byte_tokens, token_page
from allhere.analysis.static import set_static_heads, static_budget_k, top_k_heads
from allhere.analysis.stats import StatsAccumulator
from allhere.data.recall_task import RecallTask
from allhere.routing import routed_layers
from allhere.runtime.model_checkpoint import CheckpointError, load_model
from allhere.runtime.runlock import run_lock

from .plans import TASKS, plan_from_dict
from .report import goal_lines, percent, write_report
from .rundir import read_settings
from .tasks import task_data


@torch.no_grad()
def analyze_task(run: Path, name: str, target_mu: float | None = None) -> dict:
    """The statistics, static baseline (and, with ``target_mu``, the budget control) of one task."""
    settings = read_settings(run / name)
    model, _ = load_model(run / name / "aha" / "checkpoint.safetensors")
    model.eval()
    plan = plan_from_dict(settings["plan"])
    data = task_data(name, dataclasses.replace(plan, pretrain=dataclasses.replace(plan.pretrain, device="cpu")),
                     settings["data_path"])
    label = "bits_per_byte" if data.metric == "bits_per_token" else data.metric  # byte-level tokens
    quality = lambda m: {label: data.evaluate(m)[data.metric]}  # noqa: E731
    batches = data.heldout
    acc = StatsAccumulator()
    for ids in batches:
        acc.update(model(ids).routing)
    stats = acc.result()
    dynamic = quality(model)
    k = static_budget_k(stats.mu_f, stats.usage.numel())
    heads = top_k_heads(stats.usage, k)
    set_static_heads(model, heads)
    static = quality(model)
    set_static_heads(model, None)
    result = {"stats": stats.to_dict(), "dynamic": {**dynamic, "mu_f": stats.mu_f},
              "static": {**static, "mu_f": k / stats.usage.numel(), "heads": k,
                         "global_heads": [[stats.layers[i], h] for i, h in heads.nonzero().tolist()]}}
    if target_mu is not None:
        result["budget"] = budget_control(model, batches, quality, target_mu)
    result["page"] = str(token_heat_page(model, name, settings, batches[0][0], run / "analysis"))
    return result


def token_heat_page(model, name: str, settings: dict, ids: torch.Tensor, folder: Path) -> Path:
    """The AHA paper's Figure 1 for one held-out sequence: each token shaded by its global heads."""
    routing = model(ids[None]).routing
    counts = torch.stack([r.gates[0] for r in routing.per_layer]).sum(dim=(0, 1)).tolist()  # per token
    total = len(routing.per_layer) * routing.per_layer[0].gates.shape[1]
    if name == "stdlib":
        tokens = byte_tokens(ids.tolist())
    else:
        task = RecallTask(seq_len=settings["plan"]["seq_len"])
        tokens = [task.token_name(t) for t in ids.tolist()]
    note = (f"One held-out sequence of the {name} task. Darker = more of the model's {total} (layer, head) "
            "pairs on full attention at that token; hover a token for the count.")
    folder.mkdir(parents=True, exist_ok=True)
    return token_page(tokens, [int(c) for c in counts], total, f"Where AHA goes global: {name}",
                      folder / f"tokens_{name}.html", note)


def budget_control(model, batches, quality, target_mu: float) -> dict:
    """Calibrate tau on the first half of the held-out batches, measure mu_f on the second half."""
    half = max(1, len(batches) // 2)
    tau = calibrate_tau(model, batches[:half], target_mu)
    original = routed_layers(model)[0][1].cfg.tau
    set_tau(model, tau)
    acc = StatsAccumulator()
    for ids in batches[half:] or batches:
        acc.update(model(ids).routing)
    landed = {"target_mu_f": target_mu, "tau": tau, "mu_f": acc.result().mu_f, **quality(model)}
    set_tau(model, original)
    return landed


def _fmt_gap(x) -> str:
    return "never twice" if x is None else f"{x:.2f}"


def render(results: dict) -> str:
    """analysis.md: per task the busiest and quietest heads, dynamic against static, the budget control."""
    out = ["# Where global attention goes", ""]
    for name, r in results.items():
        s, dyn, sta = r["stats"], r["dynamic"], r["static"]
        metric = next(k for k in dyn if k != "mu_f")
        out += [f"## {name}", "", f"mu_f {percent(s['mu_f'])} over {s['tokens']:,} held-out tokens; the busiest "
                f"10% of heads make {100 * s['top10_share']:.0f}% of all full-attention calls.", "",
                "Busiest and quietest heads (mean gap = tokens between consecutive full-attention calls, "
                "the AHA paper's Table 3):", "", "| layer | head | mu_f | mean gap |", "|---|---|---|---|"]
        ranked = s["sorted_usage"]
        for layer, head, u in ranked[:3] + ranked[-2:]:
            row = s["layers"].index(layer)
            out.append(f"| {layer} | {head} | {percent(u)} | {_fmt_gap(s['mean_gap'][row][head])} |")
        better = (dyn[metric] < sta[metric]) if metric == "bits_per_byte" else (dyn[metric] > sta[metric])
        out += ["", "Dynamic router against the static baseline (the AHA paper's Table 5; same weights):", "",
                f"| routing | {metric} | mu_f |", "|---|---|---|",
                f"| dynamic router | {dyn[metric]:.4f} | {percent(dyn['mu_f'])} |",
                f"| static: top {sta['heads']} heads global | {sta[metric]:.4f} | {percent(sta['mu_f'])} |", ""]
        out += goal_lines({"at an equal or smaller budget the dynamic router beats the static heads": better})
        out.append("")
        if "budget" in r:
            b = r["budget"]
            out += [f"Budget control: asked for mu_f {percent(b['target_mu_f'])}, tau calibrated to {b['tau']:.4f} "
                    f"on half of the held-out data; on the other half mu_f is {percent(b['mu_f'])} "
                    f"({metric} {b[metric]:.4f} on all of it).", ""]
    return "\n".join(out) + "\n"


def analyze_run(run: str | Path, tasks: tuple[str, ...] = TASKS, target_mu: float | None = None) -> dict:
    """Analyse every task of ``tasks`` that ``run`` holds a fine-tuned AHA model of; write the results."""
    run = Path(run)
    present = [t for t in tasks if (run / t / "aha" / "checkpoint.safetensors").exists()]
    if not present:
        raise CheckpointError(f"{run} holds no fine-tuned AHA checkpoint of {', '.join(tasks)}; run allhere demo first")
    with run_lock(run):  # not while a demo writes the run
        results = {t: analyze_task(run, t, target_mu) for t in present}
        out = run / "analysis"
        write_report(out, "analysis", results, render(results))
        from allhere.analysis.plots import sorted_usage_curve

        sorted_usage_curve({t: [u for _, _, u in r["stats"]["sorted_usage"]] for t, r in results.items()},
                           out / "sorted_usage.png")
    return results
