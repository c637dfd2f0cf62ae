"""The straight-through estimator (STE) of All-or-Here attention: the one place its algebra lives.

The router's hard gate g = 1[s > tau] ("Learning When Not to Attend Globally", AHA paper Eq. 2) has a zero
gradient almost everywhere. The straight-through estimator (Eq. 3) uses g exactly in the forward pass and
treats the threshold as the identity in the backward pass. Two halves:

  - ``straight_through(scores, tau)``: the gate a mechanism hands to the attention op -- its value is
    exactly 0.0 or 1.0 (the hard gate 1[s > tau]), its gradient flows unchanged into the scores;
  - ``add_gate_gradient(out, gate, a_full, a_local)``: what every AHA op adds to its output -- zero in
    value, d out / d gate = a_full - a_local, so dL/dgate = sum over dim of dL/dout * (a_full - a_local).

The ops never threshold a gate themselves (a gate computed with tau = 0.7 is already 0 where s = 0.6):
they take a bool gate, or a float gate holding only 0 and 1, such as ``straight_through`` returns.
"""

from __future__ import annotations

import torch


def straight_through(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Value: the hard gate 1[s > tau] as ``scores``' dtype (exactly 0 or 1); gradient: identity to the
    scores (Eq. 3)."""
    hard = (scores > tau).to(scores.dtype)
    return hard + (scores - scores.detach())


def trains_gate(gate: torch.Tensor) -> bool:
    """Whether ``gate`` is a straight-through gate whose gradient the op must produce."""
    return gate.dtype != torch.bool and gate.requires_grad


def add_gate_gradient(out: torch.Tensor, gate: torch.Tensor, a_full: torch.Tensor,
                      a_local: torch.Tensor) -> torch.Tensor:
    """``out`` in value, plus the gate's straight-through gradient: out + (gate - gate.detach()) *
    (a_full - a_local) (per batch, head, token; broadcast over dim). The difference needs no autograd of
    its own (it is multiplied by an exact zero), so a caller may compute ``a_full`` without one: q, k and v
    get their gradients from the output that was used."""
    with torch.no_grad():
        diff = a_full - a_local
    return out + (gate - gate.detach()).to(out.dtype)[..., None] * diff
