"""The static baseline of the AHA paper's Table 5: rank heads by mu_f, fix the top k to full attention and the
rest to the window, with the same weights; compare with the dynamic router at the same budget."""

from __future__ import annotations

import math

import torch

from ..model import Decoder
from ..routing import routed_layers


def top_k_heads(usage: torch.Tensor, k: int) -> torch.Tensor:
    """bool [layers, heads]: True for the k heads with the highest mu_f."""
    flat = torch.zeros(usage.numel(), dtype=torch.bool)
    flat[usage.flatten().argsort(descending=True)[:k]] = True
    return flat.view_as(usage)


def static_budget_k(mu_f: float, n_heads_total: int) -> int:
    """Heads to fix global so that the static budget is at least the dynamic one (a fair or generous match)."""
    return min(n_heads_total, math.ceil(mu_f * n_heads_total - 1e-9))


def set_static_heads(model: Decoder, heads: torch.Tensor | None) -> None:
    """Fix each AHA layer's heads to full (True) or local (False): ``heads`` bool [AHA layers, heads]; None
    restores the router. Our decoder or a converted transformers model."""
    for row, (_, mech) in enumerate(routed_layers(model)):
        mech.forced_gate = None if heads is None else heads[row].clone()
