"""Plots of the AA-MoE experiment (``allhere.experiments.aamoe``): bits per byte against FLOPs per token,
the histogram of B_i and the context / expert split per layer."""

from __future__ import annotations

from pathlib import Path

from ..analysis.plots import require_matplotlib


def write_plots(folder: Path, report: dict) -> list[Path]:
    plt = require_matplotlib()
    rows = report["rows"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        ax.scatter(r["flops_per_token"] / 1e3, r["bpb"], s=30)
        ax.annotate(name, (r["flops_per_token"] / 1e3, r["bpb"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("forward FLOPs per token (thousands)")
    ax.set_ylabel("bits per byte (causal budgets)")
    ax.set_title("AA-MoE: quality against compute", fontsize=10)
    paths.append(_save(fig, plt, folder / "bpb_vs_flops.png"))

    routed = {k: r for k, r in rows.items() if r.get("layers")}
    if routed:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        width = 0.8 / len(routed)
        for i, (name, r) in enumerate(routed.items()):
            hist = [sum(lay["budget_histogram"][j] if j < len(lay["budget_histogram"]) else 0 for lay in r["layers"])
                    for j in range(max(len(lay["budget_histogram"]) for lay in r["layers"]))]
            total = max(1, sum(hist))
            axes[0].bar([j + i * width for j in range(len(hist))], [100 * c / total for c in hist], width, label=name)
            shares = [lay["context_share"] for lay in r["layers"]]
            axes[1].bar([j + i * width for j in range(len(shares))], shares, width, label=name)
        axes[0].set_xlabel("B_i (resources per token)")
        axes[0].set_ylabel("% of tokens (all layers)")
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
