"""Where global attention goes in a finished demo run: statistics, figures and the static baseline.

For each task of the run: routing statistics of the fine-tuned AHA model on the held-out data (mu_f
per layer x head, mean gap between global calls per head, the top-10% heads' share), the sorted-usage
curve, and the static baseline (the busiest heads fixed global, the rest local, same weights, a budget
at least the dynamic one) against the dynamic router. Writes analysis.md, analysis.json and PNGs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, atomic_write, load_model
from ..config import ConfigError
from ..data.recall import RecallTask
from ..demo import plan_from_dict, task_data
from .budget import calibrate_tau, set_tau
from .html import byte_tokens, token_page
from .stats import StatsAccumulator
from .static import set_static_heads, static_budget_k, top_k_heads


@torch.no_grad()
def analyze_task(run: Path, name: str, target_mu: float | None = None) -> dict:
    settings_path = run / name / "settings.json"
    if not settings_path.exists():
        raise ConfigError(f"{run / name} holds no finished demo task (no settings.json); run allhere demo first")
    settings = json.loads(settings_path.read_text())
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
        result["budget"] = _budget(model, batches, quality, target_mu)
    result["page"] = str(_token_page(model, name, settings, batches[0][0], run / "analysis"))
    return result


def _token_page(model, name: str, settings: dict, ids: torch.Tensor, folder: Path) -> Path:
    """Figure 1 of seeds/003 for one held-out sequence."""
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


def _budget(model, batches, quality, target_mu: float) -> dict:
    """Calibrate tau on the first half of the held-out batches, measure mu_f on the second half."""
    half = max(1, len(batches) // 2)
    tau = calibrate_tau(model, batches[:half], target_mu)
    original = model.aha_modules()[0][1].cfg.tau
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
    out = ["# Where global attention goes", ""]
    for name, r in results.items():
        s, dyn, sta = r["stats"], r["dynamic"], r["static"]
        metric = next(k for k in dyn if k != "mu_f")
        out += [f"## {name}", "", f"mu_f {100 * s['mu_f']:.1f}% over {s['tokens']:,} held-out tokens; the busiest "
                f"10% of heads make {100 * s['top10_share']:.0f}% of all full-attention calls.", "",
                "Busiest and quietest heads (mean gap = tokens between consecutive full-attention calls, "
                "seeds/003 Table 3):", "", "| layer | head | mu_f | mean gap |", "|---|---|---|---|"]
        ranked = s["sorted_usage"]
        for layer, head, u in ranked[:3] + ranked[-2:]:
            row = s["layers"].index(layer)
            out.append(f"| {layer} | {head} | {100 * u:.1f}% | {_fmt_gap(s['mean_gap'][row][head])} |")
        better = (dyn[metric] < sta[metric]) if metric == "bits_per_byte" else (dyn[metric] > sta[metric])
        out += ["", "Dynamic router against the static baseline (seeds/003 Table 5; same weights):", "",
                f"| routing | {metric} | mu_f |", "|---|---|---|",
                f"| dynamic router | {dyn[metric]:.4f} | {100 * dyn['mu_f']:.1f}% |",
                f"| static: top {sta['heads']} heads global | {sta[metric]:.4f} | {100 * sta['mu_f']:.1f}% |", "",
                f"- [{'x' if better else ' '}] at an equal or smaller budget the dynamic router beats the static heads",
                ""]
        if "budget" in r:
            b = r["budget"]
            out += [f"Budget control: asked for mu_f {100 * b['target_mu_f']:.1f}%, tau calibrated to {b['tau']:.4f} "
                    f"on half of the held-out data; on the other half mu_f is {100 * b['mu_f']:.1f}% "
                    f"({metric} {b[metric]:.4f} on all of it).", ""]
    return "\n".join(out) + "\n"


def analyze_run(run: str | Path, tasks: tuple[str, ...] = ("stdlib", "recall"), target_mu: float | None = None) -> dict:
    run = Path(run)
    present = [t for t in tasks if (run / t / "aha" / "checkpoint.safetensors").exists()]
    if not present:
        raise CheckpointError(f"{run} holds no fine-tuned AHA checkpoint of {', '.join(tasks)}; run allhere demo first")
    results = {t: analyze_task(run, t, target_mu) for t in present}
    out = run / "analysis"
    atomic_write(out / "analysis.json", lambda tmp: tmp.write_text(json.dumps(results, indent=1) + "\n"))
    atomic_write(out / "analysis.md", lambda tmp: tmp.write_text(render(results)))
    from .plots import sorted_usage_curve

    sorted_usage_curve({t: [u for _, _, u in r["stats"]["sorted_usage"]] for t, r in results.items()},
                       out / "sorted_usage.png")
    return results
