"""What the routers decided in one forward pass, and the statistics of the AHA paper's Eqs. 7-8.

A model returns a ``Routing`` (never global state): per AHA layer the router scores s and the hard gates
g = 1[s > tau], each [batch, heads, tokens] (a ``LayerRouting``, what a routed mechanism returns: defined
with the mechanism interface, ``allhere.mechanisms.base``). Padding positions (``padding_mask`` False) are
excluded from every mean. ``routed_layers`` and ``set_forced_gate`` find the routed mechanisms of a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mechanisms.base import LayerRouting, mechanism_layers

__all__ = ["LayerRouting", "Routing", "routed_layers", "set_forced_gate"]


@dataclass
class Routing:
    layers: list[int]  # model layer index of each entry below
    per_layer: list[LayerRouting]

    def _weights(self, padding_mask: torch.Tensor | None) -> torch.Tensor:
        ref = self.per_layer[0].gates
        if padding_mask is None:
            return torch.ones(ref.shape[0], 1, ref.shape[2], device=ref.device)
        if tuple(padding_mask.shape) != (ref.shape[0], ref.shape[2]):
            raise ValueError(f"padding_mask must be [batch, tokens] = {(ref.shape[0], ref.shape[2])}, "
                             f"got {tuple(padding_mask.shape)}")
        return padding_mask.to(device=ref.device, dtype=torch.float32)[:, None, :]

    def _mean(self, name: str, padding_mask: torch.Tensor | None) -> torch.Tensor:
        w = self._weights(padding_mask)
        heads = self.per_layer[0].gates.shape[1]
        total = sum((getattr(r, name).float() * w).sum() for r in self.per_layer)
        return total / (w.sum() * heads * len(self.per_layer)).clamp_min(1.0)

    def l_reg(self, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 7: mean router score over AHA layers, real tokens and heads (differentiable)."""
        return self._mean("scores", padding_mask)

    def mu_f(self, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 8: mean hard gate (fraction of (token, head) pairs on full attention)."""
        return self._mean("gates", padding_mask)

    def usage(self, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """mu_f per (AHA layer, head): [len(layers), heads]."""
        w = self._weights(padding_mask)
        n = (w.sum() * 1.0).clamp_min(1.0)
        return torch.stack([(r.gates.float() * w).sum(dim=(0, 2)) / n for r in self.per_layer])


def routed_layers(model) -> list[tuple[int, "torch.nn.Module"]]:
    """(layer index, mechanism module) of every layer whose mechanism routes (e.g. AHA), in our decoder
    or in a converted Hugging Face model (whose mechanisms know their layer: ``layer_index``)."""
    return [(getattr(m, "layer_index", i), m) for i, m in enumerate(mechanism_layers(model)) if m.routed]


def set_forced_gate(model, value) -> None:
    """Force every routed gate to full (True) or local (False) attention, or per head (a bool tensor
    [heads] for every layer); None restores routing. Works on our decoder and converted HF models."""
    layers = routed_layers(model)
    if not layers:
        raise ValueError("this model has no routed layers (AHA); there is no gate to force")
    for _, m in layers:
        m.forced_gate = value
