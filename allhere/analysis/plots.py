"""Layer x head heatmaps of mu_f (Fig. 3 of the AHA paper)."""

from __future__ import annotations

from pathlib import Path


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'allhere[plot]'") from e
    return plt


def usage_heatmaps(panels: dict[str, list[list[float]]], path: str | Path,
                   layers: dict[str, list[int]] | None = None) -> Path:
    """One panel per entry: rows = AHA layers, columns = heads, colour = mu_f in [0, 1]."""
    plt = require_matplotlib()
    fig = usage_figure(panels, layers)
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def usage_figure(panels: dict[str, list[list[float]]], layers: dict[str, list[int]] | None = None):
    """The matplotlib figure of ``usage_heatmaps`` (the caller saves and closes it)."""
    plt = require_matplotlib()
    tall = max(3.4, 0.28 * max(len(u) for u in panels.values()) + 1.2)  # a real model's 30 layers: taller
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), tall), squeeze=False)
    for ax, (title, usage) in zip(axes[0], panels.items()):
        im = ax.imshow(usage, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        rows = (layers or {}).get(title, list(range(len(usage))))
        ax.set_yticks(range(len(usage)), [str(r) for r in rows])
        ax.set_xticks(range(len(usage[0])))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=10)
        for i, row in enumerate(usage):
            for j, val in enumerate(row):
                ax.text(j, i, f"{val:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if val > 0.6 else "white")
    fig.colorbar(im, ax=axes[0].tolist(), label="mu_f (share of tokens on full attention)")
    return fig


def sorted_usage_curve(curves: dict[str, list[float]], path: str | Path) -> Path:
    """mu_f of every head, busiest first (Fig. 4 of the AHA paper); one line per entry."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=name)
    ax.set_xlabel("head rank (busiest first)")
    ax.set_ylabel("mu_f of the head")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
