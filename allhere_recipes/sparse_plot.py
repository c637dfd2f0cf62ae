"""Figures of ``allhere patterns``: the masks side by side, edges coloured by component (the figure of
sparse attention surveys), and the receptive field against depth."""

from __future__ import annotations

from pathlib import Path

import torch

from allhere.analysis.plots import require_matplotlib

from .sparse_family import KINDS

COLOURS = {"dense": (0.55, 0.55, 0.55), "window": (0.27, 0.45, 0.69), "global": (0.87, 0.52, 0.32),
           "sink": (0.51, 0.37, 0.66), "random": (0.33, 0.66, 0.41)}


def edge_image(components: dict[str, torch.Tensor]) -> torch.Tensor:
    """RGB float [n, n, 3] of one mask: white where no query reads the key, else the colour of the first
    component (in ``KINDS`` order) that allows the edge."""
    n = next(iter(components.values())).shape[-1]
    img = torch.ones(n, n, 3)
    painted = torch.zeros(n, n, dtype=torch.bool)
    for kind in KINDS:
        if kind not in components:
            continue
        here = components[kind].bool() & ~painted
        img[here] = torch.tensor(COLOURS[kind])
        painted |= here
    return img


def mask_figure(rows: dict[str, list[dict]], path: str | Path, subtitle: str = "") -> Path:
    """One row of panels per entry of ``rows`` (e.g. "decoder", "encoder"); each panel a dict with
    ``title``, ``density`` and ``components`` (kind -> bool [n, n]). Query positions down, keys across."""
    plt = require_matplotlib()
    from matplotlib.patches import Patch

    cols = max(len(panels) for panels in rows.values())
    fig, axes = plt.subplots(len(rows), cols, figsize=(2.3 * cols, 2.9 * len(rows) + 0.6), squeeze=False)
    used = set()
    for r, (label, panels) in enumerate(rows.items()):
        for c in range(cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c >= len(panels):
                ax.axis("off")
                continue
            p = panels[c]
            used |= {k for k, m in p["components"].items() if bool(m.any())}
            ax.imshow(edge_image(p["components"]).numpy(), interpolation="nearest")
            ax.set_title(f"{p['title']}\ndensity {100 * p['density']:.1f}%", fontsize=7)
            if c == 0:
                ax.set_ylabel(f"{label}\nquery", fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("key", fontsize=7)
    handles = [Patch(color=COLOURS[k], label=k) for k in KINDS if k in used]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    if subtitle:
        fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def receptive_figure(curves: dict[str, dict[str, list[int]]], rules: dict[str, list[int]], path: str | Path) -> Path:
    """Input positions a token depends on after 1..L layers (the most over tokens): one panel per mode
    (curves: mode -> pattern -> values per layer), the rule of thumb of the mode (L x w; 2 L x w for an
    encoder) dashed."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, len(curves), figsize=(5.2 * len(curves), 3.6), squeeze=False)
    for ax, (mode, lines) in zip(axes[0], curves.items()):
        rule = rules[mode]
        for name, values in lines.items():
            ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=name)
        ax.plot(range(1, len(rule) + 1), rule, "k--", linewidth=1, label="rule of thumb")
        ax.set_xlabel("layers L")
        ax.set_ylabel("input positions a token depends on (most)")
        ax.set_xticks(range(1, len(rule) + 1))
        ax.set_yscale("log")
        ax.set_title(mode, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
