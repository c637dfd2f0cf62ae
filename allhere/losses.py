"""The training objective: L = L_LM + lambda * L_reg (Eq. 6 of the AHA paper, "Learning When Not to Attend
Globally"); without routed layers L = L_LM. Mechanisms with a loss of their own (``aux_loss``, e.g. AA-MoE's
budget predictor) add it to the total."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import DecoderOutput


@dataclass
class Loss:
    total: torch.Tensor  # L_LM + lambda * L_reg + the mechanisms' aux losses (what to backpropagate)
    lm: torch.Tensor  # next-token cross-entropy, nats per token
    l_reg: torch.Tensor | None  # mean router score (None without routed layers)
    mu_f: torch.Tensor | None  # mean hard gate (None without routed layers)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None,
            loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from position t.

    padding_mask [batch, tokens] (True = real token) drops targets that are padding; loss_mask
    [batch, tokens] (True = train on this target token) restricts the loss further (e.g. assistant turns).
    """
    targets = input_ids[:, 1:]
    keep = torch.ones_like(targets, dtype=torch.bool)
    if padding_mask is not None:
        keep &= padding_mask[:, 1:].bool()
    if loss_mask is not None:
        keep &= loss_mask[:, 1:].bool()
    ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none")
    return (ce * keep.flatten()).sum() / keep.sum().clamp_min(1)


def training_loss(out: DecoderOutput, input_ids: torch.Tensor, lam: float, padding_mask: torch.Tensor | None = None,
             loss_mask: torch.Tensor | None = None) -> Loss:
    lm = lm_loss(out.logits, input_ids, padding_mask, loss_mask)
    aux = 0.0 if out.aux_loss is None else out.aux_loss  # the mechanisms' own losses (e.g. a budget predictor)
    if out.routing is None:
        return Loss(lm + aux, lm, None, None)
    l_reg = out.routing.l_reg(padding_mask)
    return Loss(lm + lam * l_reg + aux, lm, l_reg, out.routing.mu_f(padding_mask).detach())
