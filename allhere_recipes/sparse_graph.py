"""Attention masks as graphs: what a token depends on after L layers, and in how many layers one token
can reach another.

A layer's graph ``A`` is a bool matrix [n, n]: ``A[i, j]`` = query i reads key j (heads united: a token
depends on what any of its heads reads). The residual stream carries every token to itself, so after
layers 1..l token i depends on input j iff ``R_l[i, j]``, with ``R_0 = I`` and
``R_l = (A_l | I) R_(l-1)`` (boolean product). For a pattern that is the same in every layer, the first l
with ``R_l[i, j]`` is the shortest path from i to j in ``A`` (hops); for a per-layer pattern (a dilation
schedule) it is the number of stacked layers needed.

The products run as float32 matrix products on dense [n, n] matrices (fast in the low thousands), only
over the columns j that may still change: a column unchanged by each layer of the cycle is final.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def pair_mask(n: int, causal: bool) -> torch.Tensor:
    """bool [n, n]: the (i, j) pairs the hop figures are over: i > j (causal), i != j (encoder)."""
    i = torch.arange(n)
    return (i[:, None] > i[None, :]) if causal else (i[:, None] != i[None, :])


def reach_after(graphs: Sequence[torch.Tensor]) -> torch.Tensor:
    """bool [n, n] R_L after the layers ``graphs`` (bool [n, n] each, the first layer first)."""
    n = graphs[0].shape[-1]
    eye = torch.eye(n, dtype=torch.bool)
    reach = eye.float()
    for a in graphs:
        reach = (((a.bool() | eye).float() @ reach) > 0).float()
    return reach > 0


def reach_stats(reach: torch.Tensor, causal: bool) -> dict:
    """Receptive field of every token from R [n, n] (bool): positions it depends on (max, mean, of the last
    token) and the farthest of them (back for causal, either side for an encoder)."""
    n = reach.shape[0]
    counts = reach.sum(1)
    i = torch.arange(n)
    pos = torch.where(reach, i[None, :], n)  # positions reached, n where not
    first = pos.min(1).values
    far = i - first
    if not causal:
        last = torch.where(reach, i[None, :], -1).max(1).values
        far = torch.maximum(far, last - i)
    return {"max_positions": int(counts.max()), "mean_positions": float(counts.float().mean()),
            "last_token_positions": int(counts[-1]), "farthest": int(far.max())}


@dataclass
class GraphResult:
    """What ``propagate`` measured: receptive fields after 1..layers layers, and hops over the pairs."""

    receptive: list = field(default_factory=list)  # reach_stats after layer 1, 2, ..., layers
    hops_histogram: dict = field(default_factory=dict)  # hops -> pairs first connected after that many layers
    pairs: int = 0
    steps: int = 0  # layers propagated until nothing changed

    @property
    def reached(self) -> int:
        return sum(self.hops_histogram.values())

    def hops(self) -> dict:
        """Mean and max hops over the connected pairs, the share of pairs never connected."""
        reached = self.reached
        mean = sum(h * c for h, c in self.hops_histogram.items()) / reached if reached else None
        return {"mean": mean, "max": max(self.hops_histogram) if reached else None,
                "unreachable_share": 1.0 - reached / self.pairs if self.pairs else 0.0,
                "histogram": {str(h): c for h, c in sorted(self.hops_histogram.items())}}


def propagate(graph: Callable[[int], torch.Tensor], period: int, n: int, layers: int, causal: bool,
              max_steps: int | None = None, progress: Callable[[str], None] | None = None) -> GraphResult:
    """Stack layers l = 0, 1, 2, ... with graphs ``graph(l % period)`` (bool [n, n]) until no column changes
    for a whole period (or ``max_steps``): receptive fields after 1..``layers`` layers, and per pair the
    first layer at which it is connected."""
    graphs = [(graph(l).bool() | torch.eye(n, dtype=torch.bool)).float() for l in range(period)]
    pairs = pair_mask(n, causal)
    reach = torch.eye(n)  # float 0 / 1: R_0 = I
    still = torch.zeros(n, dtype=torch.long)  # per column: consecutive layers that left it unchanged
    out = GraphResult(pairs=int(pairs.sum()))
    max_steps = max_steps or n * period + period
    step = 0
    while step < max_steps:
        active = (still < period).nonzero().flatten()
        if active.numel() == 0 and step >= layers:
            break
        a = graphs[step % period]
        step += 1
        if active.numel():
            old = reach[:, active] > 0
            new = (a @ reach[:, active]) > 0
            grown = new & ~old
            count = int((grown & pairs[:, active]).sum())
            if count:
                out.hops_histogram[step] = count
            changed = grown.any(0)
            still[active] = torch.where(changed, 0, still[active] + 1)
            reach[:, active] = new.float()
        if step <= layers:
            out.receptive.append(reach_stats(reach > 0, causal))
        if progress and step % 8 == 0:
            progress(f"  layer {step}: {out.reached:,} of {out.pairs:,} pairs connected")
    out.steps = step
    return out


def union_heads(mask: torch.Tensor) -> torch.Tensor:
    """bool [n, n] of a [heads, n, n] mask: a token depends on what any of its heads reads."""
    return mask.any(0) if mask.dim() == 3 else mask


def scores(masks_per_layer: Sequence[torch.Tensor]) -> float:
    """Allowed (query, key) pairs of one layer, averaged over heads and over the given layers."""
    return sum(float(m.reshape(-1, *m.shape[-2:]).sum((1, 2)).float().mean())
               for m in masks_per_layer) / len(masks_per_layer)
