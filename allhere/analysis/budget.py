"""Budget control beyond the paper: calibrate the gate threshold tau on held-out data so that a trained
AHA model uses a requested share of full attention, then check how close it lands on other data."""

from __future__ import annotations

import dataclasses

import torch

from ..model import Decoder
from ..routing import routed_layers


@torch.no_grad()
def calibrate_tau(model: Decoder, batches, target_mu: float, max_scores: int = 4_000_000) -> float:
    """tau such that a share ``target_mu`` of the router scores on ``batches`` lies above it."""
    if not 0.0 < target_mu < 1.0:
        raise ValueError(f"target mu_f must be strictly between 0 and 1, got {target_mu}")
    model.eval()
    scores = torch.cat([r.scores.flatten() for ids in batches for r in model(ids).routing.per_layer])
    if scores.numel() > max_scores:  # torch.quantile has a size limit; an even subsample is as good
        scores = scores[torch.linspace(0, scores.numel() - 1, max_scores).long()]
    tau = torch.quantile(scores.double(), 1.0 - target_mu).item()
    return min(max(tau, 1e-6), 1.0 - 1e-6)


def set_tau(model: Decoder, tau: float) -> None:
    for _, mech in routed_layers(model):
        mech.cfg = dataclasses.replace(mech.cfg, tau=tau)
