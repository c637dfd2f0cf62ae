"""The figure of ``allhere compare``: quality against keys read per query, one panel per task; the means
over the seeds, with their standard deviations as error bars when there are two seeds or more."""

from __future__ import annotations

from pathlib import Path

from allhere.analysis.plots import require_matplotlib


def plot_compare(report: dict, path: Path) -> Path:
    plt = require_matplotlib()
    tasks = report["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, (name, t) in zip(axes[0], tasks.items()):
        points: dict[tuple, tuple] = {}  # identical masks give identical points: one label for them
        for label, r in t["rows"].items():
            x, y = r["scores_per_query"], r[t["metric"]]
            points.setdefault((round(x["mean"], 6), round(y["mean"], 6)), (x, y, []))[2].append(label)
        for x, y, labels in points.values():  # means, with the standard deviations over seeds as error bars
            ax.errorbar(x["mean"], y["mean"], xerr=x["std"], yerr=y["std"], fmt="o", ms=5, capsize=3)
            ax.annotate(" = ".join(labels), (x["mean"], y["mean"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("keys read per query (log)")
        ax.set_ylabel(f"{t['metric']} ({'higher' if t['higher_is_better'] else 'lower'} is better)")
        ax.margins(x=0.25)
        ax.set_title(f"{name}: n = {t['seq_len']}, budget w = {t['window']}, {t['steps']} steps, "
                     f"{len(t['seeds'])} seed{'s' if len(t['seeds']) > 1 else ''}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
