"""Fit a layer's router to the teacher's labels: a linear map from the router's input (the attention block's input
X, what ``AHAConfig``'s router reads) to a standardised transform of what reading locally costs each head.

The fit is ridge regression, solved in closed form from sums accumulated over the calibration batches (X^T X and
X^T Y per layer, in float64), so the calibration text is read once and nothing of size tokens x d is kept. The
router's sigmoid then ranks (token, head) pairs as the teacher does, as far as a linear map of X can; the bias
that puts a share ``mu_f`` of the calibration pairs above the gate's threshold is set afterwards
(``allhere.teaching.teach``).
"""

from __future__ import annotations

import torch

FLOOR = 1e-3  # labels below this cost count as this (the log of a label of 0 is not finite)


def target(cost: torch.Tensor) -> torch.Tensor:
    """The regression target of a cost (``labels.local_cost``): its log, floored."""
    return cost.float().clamp_min(FLOOR).log()


class RidgeFit:
    """Per routed layer, the sums of a ridge regression of ``target(cost)`` [tokens, heads] on [X, 1]."""

    def __init__(self, layers: int, d_model: int, heads: int) -> None:
        self.xtx = torch.zeros(layers, d_model + 1, d_model + 1, dtype=torch.float64)
        self.xty = torch.zeros(layers, d_model + 1, heads, dtype=torch.float64)
        self.y_sum = torch.zeros((), dtype=torch.float64)
        self.y_sq = torch.zeros((), dtype=torch.float64)
        self.count = 0

    def add(self, row: int, x: torch.Tensor, cost: torch.Tensor) -> None:
        """x [tokens, d_model], cost [tokens, heads] of routed layer ``row``."""
        xa = torch.cat([x.reshape(-1, x.shape[-1]).double(), x.new_ones(x.numel() // x.shape[-1], 1).double()], 1)
        y = target(cost).reshape(xa.shape[0], -1).double()
        self.xtx[row] += xa.T @ xa
        self.xty[row] += xa.T @ y
        self.y_sum += y.sum()
        self.y_sq += (y * y).sum()
        self.count += y.numel()

    def solve(self, ridge: float = 1e-3) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (weight [heads, d_model], bias [heads]) in float32, predicting the standardised target (mean
        0 and variance 1 over every layer's pairs): the same units in every layer, so one threshold ranks them
        all. ``ridge``: the penalty as a share of the mean diagonal of X^T X (the bias column unpenalised)."""
        mean = self.y_sum / self.count
        std = (self.y_sq / self.count - mean * mean).clamp_min(1e-12).sqrt()
        out = []
        for xtx, xty in zip(self.xtx, self.xty):
            d = xtx.shape[0] - 1
            penalty = torch.zeros_like(xtx)
            penalty.diagonal()[:d] = ridge * xtx.diagonal()[:d].mean()
            w = torch.linalg.solve(xtx + penalty, xty)  # [d + 1, heads]
            w[d] -= mean  # the intercept absorbs the mean; then one scale for all
            w = (w / std).float()
            out.append((w[:d].T.contiguous(), w[d].clone()))
        return out
