"""AHA's gate as pure functions of tensors: the router's scores (Eq. 1 of "Learning When Not to Attend Globally")
and the hard gate from the attention block's input and the linear router's weights, for a host that holds those
weights itself. No host is named."""

from __future__ import annotations

import torch


def router_scores(logits: torch.Tensor) -> torch.Tensor:
    """The router's scores s = sigmoid(logits) in fp32 (Eq. 1), same shape: ``logits`` = X W_router (+ bias),
    per (token, head)."""
    return torch.sigmoid(logits.float())


def hidden_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tau: float,
                forced: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """AHA's gate from the attention block's input: x [..., d_model], weight [heads, d_model], bias [heads] or
    None -> (scores [..., heads] fp32, hard gate [..., heads] bool: True = full causal attention, False = the
    window). ``forced`` True / False sets every gate global / local (the scores are still computed)."""
    s = router_scores(torch.nn.functional.linear(x, weight, bias))
    hard = s > tau
    if forced is not None:
        hard = torch.full_like(hard, bool(forced))
    return s, hard
