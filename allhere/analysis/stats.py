"""Routing statistics over a dataset (section 3.3 of the AHA paper): mu_f per layer x head (Fig. 3), the average
gap between consecutive full-attention calls of each head (Table 3), heads sorted by usage (Fig. 4) and
the share of all full-attention use taken by the busiest heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..routing import Routing


@dataclass
class RoutingStats:
    layers: list[int]  # model layer index of each row
    usage: torch.Tensor  # [layers, heads] mu_f per head
    gap_sum: torch.Tensor  # [layers, heads] sum over sequences of (last - first global position)
    gap_count: torch.Tensor  # [layers, heads] number of consecutive pairs of global calls
    tokens: int  # real tokens seen

    @property
    def mu_f(self) -> float:
        return self.usage.mean().item()

    @property
    def mean_gap(self) -> torch.Tensor:
        """[layers, heads] mean tokens between consecutive full-attention calls; nan with fewer than two calls
        in every sequence."""
        return torch.where(self.gap_count > 0, self.gap_sum / self.gap_count.clamp_min(1), float("nan"))

    def sorted_usage(self) -> list[tuple[int, int, float]]:
        """(layer, head, mu_f) of every head, busiest first."""
        flat = [(self.layers[i], h, self.usage[i, h].item()) for i in range(self.usage.shape[0])
                for h in range(self.usage.shape[1])]
        return sorted(flat, key=lambda t: -t[2])

    def top_share(self, fraction: float = 0.1) -> float:
        """Share of all full-attention calls made by the busiest ``fraction`` of heads (at least one head)."""
        u = self.usage.flatten().sort(descending=True).values
        k = max(1, math.ceil(fraction * len(u)))
        return (u[:k].sum() / u.sum().clamp_min(1e-12)).item()

    def to_dict(self) -> dict:
        gap = self.mean_gap
        return {"mu_f": self.mu_f, "tokens": self.tokens, "layers": self.layers, "usage": self.usage.tolist(),
                "mean_gap": [[None if math.isnan(x) else x for x in row] for row in gap.tolist()],
                "top10_share": self.top_share(0.1), "sorted_usage": self.sorted_usage()}


class StatsAccumulator:
    """Feed it the ``Routing`` of every batch; ``result()`` gives the statistics over all of them."""

    def __init__(self) -> None:
        self.layers: list[int] | None = None
        self.count = self.gap_sum = self.gap_count = None
        self.tokens = 0

    def update(self, routing: Routing, padding_mask: torch.Tensor | None = None) -> None:
        gates = torch.stack([r.gates for r in routing.per_layer]).detach().cpu()  # [L, b, h, n]
        if padding_mask is not None:
            gates = gates & padding_mask.cpu().bool()[None, :, None, :]
        n = gates.shape[-1]
        calls = gates.sum(-1)  # [L, b, h]
        first = gates.float().argmax(-1)
        last = n - 1 - gates.flip(-1).float().argmax(-1)
        two = calls >= 2
        gap_sum = torch.where(two, (last - first).float(), 0.0).sum(1)
        gap_count = torch.where(two, calls - 1, 0).sum(1).float()
        if self.layers is None:
            self.layers = list(routing.layers)
            self.count, self.gap_sum, self.gap_count = calls.sum(1).float(), gap_sum, gap_count
        else:
            self.count += calls.sum(1)
            self.gap_sum += gap_sum
            self.gap_count += gap_count
        self.tokens += int(padding_mask.sum()) if padding_mask is not None else gates.shape[1] * n

    def result(self) -> RoutingStats:
        if self.layers is None:
            raise ValueError("no routing was recorded (does the model have AHA layers?)")
        return RoutingStats(self.layers, self.count / self.tokens, self.gap_sum, self.gap_count, self.tokens)
