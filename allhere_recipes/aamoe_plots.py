"""Plots of the AA-MoE experiment (``allhere_recipes.aamoe``): bits per byte against FLOPs per token,
learning curves, accuracy per kind of query (mixed task), the histogram of B_i and the context / expert
split per layer.
Error bars: the standard deviation over seeds (none with one seed)."""

from __future__ import annotations

from pathlib import Path

from allhere.analysis.plots import require_matplotlib


def _err(s: dict, scale: float = 1.0) -> float:
    return 0.0 if s.get("std") is None else scale * s["std"]


def write_plots(folder: Path, report: dict) -> list[Path]:
    plt = require_matplotlib()
    rows = report["rows"]
    paths = []
    if not rows:
        return paths

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        x, y = r["flops_per_token"]["mean"] / 1e3, r["bpb"]["mean"]
        ax.errorbar(x, y, yerr=_err(r["bpb"]), fmt="o", ms=5, capsize=3)
        ax.annotate(f"{name} (n={r['bpb']['n']})", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("forward FLOPs per token (thousands)")
    ax.set_ylabel("bits per byte (causal budgets), mean ± sd over seeds")
    ax.set_title(f"AA-MoE: quality against compute ({report['task']})", fontsize=10)
    paths.append(_save(fig, plt, folder / "bpb_vs_flops.png"))

    curves = {k: c for k, c in report.get("curves", {}).items() if c and all(c.values())}
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, by_seed in curves.items():
            steps = [step for step, _ in next(iter(by_seed.values()))]
            runs = [[b for _, b in c] for c in by_seed.values() if len(c) == len(steps)]
            mean = [sum(v) / len(v) for v in zip(*runs)]
            line, = ax.plot(steps, mean, marker=".", label=f"{name} (n={len(runs)})")
            if len(runs) > 1:
                sd = [(sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 for v, m in zip(zip(*runs), mean)]
                ax.fill_between(steps, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                                color=line.get_color(), alpha=0.2)
        ax.set_xlabel("training step")
        ax.set_ylabel("training bits per byte (one batch), mean ± sd")
        ax.set_title(f"AA-MoE: learning curves ({report['task']})", fontsize=10)
        ax.legend(fontsize=7)
        paths.append(_save(fig, plt, folder / "learning_curves.png"))

    accs = {k: r for k, r in rows.items() if "acc_table" in r}
    if accs:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        xs = range(len(accs))
        for j, kind in enumerate(("table", "context")):
            key = f"acc_{kind}"
            ax.bar([x + 0.4 * j for x in xs], [100 * r[key]["mean"] for r in accs.values()], 0.4,
                   yerr=[_err(r[key], 100) for r in accs.values()], capsize=3, label=f"{kind} queries")
        ax.set_xticks([x + 0.2 for x in xs], list(accs), fontsize=7, rotation=20)
        ax.set_ylabel("% of queries answered (mean ± sd)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=7)
        paths.append(_save(fig, plt, folder / "accuracy.png"))

    routed = {k: r for k, r in rows.items() if r.get("layers")}
    if routed:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        width = 0.8 / len(routed)
        for i, (name, r) in enumerate(routed.items()):
            width_h = max(len(lay["budget_histogram"]) for lay in r["layers"])
            hist = [sum(lay["budget_histogram"][j] for lay in r["layers"] if j < len(lay["budget_histogram"]))
                    for j in range(width_h)]
            total = max(1, sum(hist))
            axes[0].bar([j + i * width for j in range(len(hist))], [100 * c / total for c in hist], width, label=name)
            shares = [lay["context_share"] for lay in r["layers"]]
            axes[1].bar([j + i * width for j in range(len(shares))], [s["mean"] for s in shares], width,
                        yerr=[_err(s) for s in shares], capsize=3, label=name)
        axes[0].set_xlabel("B_i (resources per token)")
        axes[0].set_ylabel("% of tokens (all layers and seeds)")
        axes[0].legend(fontsize=7)
        axes[1].set_xlabel("layer")
        axes[1].set_ylabel("share of chosen resources that are context chunks")
        axes[1].set_ylim(0, 1)
        paths.append(_save(fig, plt, folder / "budgets.png"))
    return paths


def _save(fig, plt, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
