"""Held-out loss of a language model on fixed windows, with mu_f overall and per (layer, head)."""

from __future__ import annotations

import math

import torch

from ..losses import lm_loss
from ..mechanisms.base import mechanism_layers
from ..model import Decoder


@torch.no_grad()
def evaluate_lm(model: Decoder, windows: torch.Tensor, batch_size: int = 16, device: str = "cpu") -> dict:
    """windows [k, seq] int64. Returns loss (nats/token), bits_per_token, mu_f (1.0 for a model without
    routers: it always attends fully; 0.0 for pure sliding window) and usage [layers, heads] of the routed layers."""
    model.eval().to(device)
    total, count, gates, usage = 0.0, 0, 0.0, None
    for chunk in windows.split(batch_size):
        ids = chunk.to(device)
        out = model(ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        total += lm_loss(out.logits, ids).item() * n
        count += n
        if out.routing is not None:
            gates += out.routing.mu_f().item() * ids.shape[0]
            u = out.routing.usage() * ids.shape[0]
            usage = u if usage is None else usage + u
    loss = total / count
    result = {"loss": loss, "bits_per_token": loss / math.log(2), "mu_f": static_mu_f(model)}
    if usage is not None:
        result["mu_f"] = gates / windows.shape[0]
        result["usage"] = (usage / windows.shape[0]).tolist()
    return result


def static_mu_f(model: Decoder) -> float:
    """Share of full attention of a model without routers: 1 per layer whose mechanism reads every
    preceding token (full; DAR, whose distant tokens are compressed but still attended), 0 per layer that
    does not (sliding); 1 for a model with no mechanism at all (a plain transformers model attends fully)."""
    layers = mechanism_layers(model)
    return sum(m.reads_all_keys for m in layers) / len(layers) if layers else 1.0
