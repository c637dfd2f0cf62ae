"""Budgets of AA-MoE ("Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin):
the sequence-level share B_i = floor(B b_i), b_i = softmax over the sequence of w_B^T h_i, and the causal
predictor that stands in for it where the future is unknown (generation, perplexity).

Everything is in log-relative units t_i = log(L b_i) = u_i - logmeanexp_j(u_j) (u = w_B^T h): the
continuous budget is S_i = beta exp(t_i) with beta the configured budget per token (B = beta L), which
keeps the per-token budget the same at any sequence length.

The causal predictor follows Mixture-of-Depths (arXiv:2404.02258, Section 3.5: an auxiliary predictor
that sees only the current and past tokens, trained to mimic the non-causal routing decision):
  - "learned": a small MLP on h_i predicts t_i; loss = mean squared error against t_i (detached), so a
    budget is fitted as a ratio (over- and under-estimating by the same factor cost the same) and the
    prediction stays valid when beta changes (B/2, 2B) because it predicts the share, not B_i. Its input
    is detached unless ``predictor_trains_trunk`` (MoD's choice: the predictor must not shape the trunk).
    Its loss is the layer's ``aux_loss``: ``allhere.losses.training_loss`` adds it to the total.
  - "prefix": no parameters: the softmax normaliser over the tokens seen so far,
    t_i = u_i - logmeanexp_{j <= i}(u_j).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sequence_log_share(u: torch.Tensor) -> torch.Tensor:
    """t_i = log(L b_i) with b = softmax over the sequence (dim -1 of u [b, L]): non-causal."""
    return u - torch.logsumexp(u, -1, keepdim=True) + math.log(u.shape[-1])


def prefix_log_share(u: torch.Tensor, lse_before: torch.Tensor | None = None, seen: int = 0) -> torch.Tensor:
    """t_i = u_i - logmeanexp over every token up to i; ``lse_before`` [b] / ``seen``: the running
    logsumexp and count of the tokens before u (a cache)."""
    lse = torch.logcumsumexp(u, -1)
    if lse_before is not None:
        lse = torch.logaddexp(lse, lse_before[:, None])
    count = seen + torch.arange(1, u.shape[-1] + 1, device=u.device, dtype=u.dtype)
    return u - lse + count.log()


class BudgetPredictor(nn.Module):
    """MLP d -> hidden -> 1 predicting t_i from h_i; starts at t = 0 (the uniform share)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.net[0].weight, 0.0, self.net[0].in_features ** -0.5)
            self.net[0].bias.zero_()
            self.net[2].weight.zero_()
            self.net[2].bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h.float()).squeeze(-1).clamp(-20.0, 20.0)
