"""Routers taught by the full model: AHA's routers set from the model's own attention, with no fine-tuning.

With the weights as they are and every gate global, the model reads calibration text; for every (token, head) of
every AHA layer the teacher measures what reading locally would cost (``labels.local_cost``: how far the head's
output moves, or the attention mass it would lose); each layer's router is fitted to that cost from its own
input (``fit.RidgeFit``); then the routers' biases are shifted so that a share ``mu_f`` of the calibration
(token, head) pairs goes global. Two passes over the text, no gradients.

The methods that make local/global choices work on a pretrained model with little compute learn the gates
against the full model itself, not from the language-model loss alone: DuoAttention (arXiv:2410.10819),
SeerAttention (arXiv:2410.13276). Here the gate stays AHA's per (token, head) and the teacher's signal is per
(token, head) too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from ..routing import routed_layers, set_forced_gate
from ..validation import ConfigError
from .fit import RidgeFit
from .labels import LABELS, local_cost
from .observe import observe_routed

BUDGETS = ("layer", "model")


@dataclass
class Teaching:
    """What a teaching pass found: per routed layer the share of calibration pairs its router sends global, per
    (layer, head) the teacher's mean cost (for static heads at the same budget) and how well the routers rank."""

    mu_f: float  # the share of calibration (token, head) pairs global after teaching
    layer_mu_f: list[float]  # per routed layer
    head_cost: list[list[float]]  # [layers][heads]: the teacher's mean cost per head (static heads rank by it)
    recall: float  # of the teacher's top ``mu_f`` pairs, the share the routers send global
    tokens: int  # calibration tokens read
    label: str
    budget: str
    extra: dict = field(default_factory=dict)


def _router(mech):
    """(weight [heads, d], bias [heads] or None) of an AHA mechanism's router, whichever its kind."""
    if mech.cfg.router == "linear":
        return mech.router.weight, mech.router.bias
    return mech.q_router, mech.router_bias


def _check(model) -> list:
    layers = [m for _, m in routed_layers(model)]
    if not layers:
        raise ConfigError("teaching routers: this model has no routed (AHA) layers")
    for m in layers:
        if _router(m)[1] is None:
            raise ConfigError("teaching routers: AHAConfig.router_bias = False leaves no bias to set the budget with")
    return layers


@torch.no_grad()
def _pass(model, batches: Iterable[torch.Tensor], fn: Callable) -> int:
    """Every batch through ``model`` with every gate global, ``fn(row, mech, q, k, v, call)`` per routed layer;
    returns the tokens read."""
    tokens = 0
    set_forced_gate(model, True)
    try:
        with observe_routed(model, fn):
            for ids in batches:
                model(ids)
                tokens += ids.numel()
    finally:
        set_forced_gate(model, None)
    return tokens


def teach_routers(model, batches: list[torch.Tensor], mu_f: float, label: str = "output", budget: str = "layer",
                  ridge: float = 1e-3, done: Callable[[], None] | None = None) -> Teaching:
    """Teach every AHA router of ``model`` (our ``Decoder`` or a converted transformers model) from the model's own
    attention on ``batches`` (token ids [b, n] each, no padding), and set their biases so that a share ``mu_f``
    of the calibration (token, head) pairs is global: per layer (``budget="layer"``: every layer gets mu_f) or
    over the whole model (``"model"``: the layers whose heads the teacher finds costlier get more). ``label``:
    ``labels.LABELS``. ``done()`` is called after each batch of each pass. Returns a ``Teaching``."""
    if not (isinstance(mu_f, (int, float)) and 0.0 < mu_f < 1.0):
        raise ConfigError(f"teaching routers: mu_f = {mu_f!r} is invalid: expected a number strictly between 0 and 1")
    if label not in LABELS or budget not in BUDGETS:
        raise ConfigError(f"teaching routers: label must be one of {LABELS} and budget one of {BUDGETS}")
    layers = _check(model)
    was_training = model.training
    model.eval()
    heads = layers[0].dims.n_heads
    fit = RidgeFit(len(layers), layers[0].dims.d_model, heads)
    costs: list[list[torch.Tensor]] = [[] for _ in layers]

    def observe_cost(row, mech, q, k, v, call):
        if call.segment_starts is not None:
            raise ConfigError("teaching routers: calibration batches must be whole sequences (no padding)")
        cost = local_cost(q, k, v, mech.cfg.window, mech.cfg.sinks, call.scale, label)  # [b, heads, n]
        # the first ``window`` positions read their whole prefix either way: no label there to learn from
        far = slice(mech.cfg.window, None)
        x = call.x[:, far]
        fit.add(row, x.reshape(-1, x.shape[-1]), cost[..., far].transpose(1, 2).reshape(-1, heads))
        costs[row].append(cost[..., far].transpose(1, 2).reshape(-1, heads))
        if row == len(layers) - 1 and done is not None:
            done()

    tokens = _pass(model, batches, observe_cost)
    for mech, (weight, bias) in zip(layers, fit.solve(ridge)):
        w, b = _router(mech)
        w.data.copy_(weight.to(w))
        b.data.copy_(bias.to(b))
    logits: list[list[torch.Tensor]] = [[] for _ in layers]  # per layer, per batch [b, n, heads]

    def observe_logits(row, mech, q, k, v, call):
        w, b = _router(mech)
        logits[row].append(torch.nn.functional.linear(call.x.float(), w.float(), b.float()))
        if row == len(layers) - 1 and done is not None:
            done()

    _pass(model, batches, observe_logits)
    z = [torch.cat([zb.reshape(-1, heads) for zb in rows]) for rows in logits]  # per layer [tokens, heads]
    shifts = _shifts(z, mu_f, budget)
    for mech, shift in zip(layers, shifts):
        b = _router(mech)[1]
        b.data.add_(shift + math.log(mech.cfg.tau / (1.0 - mech.cfg.tau)))  # the gate is sigmoid(z) > tau
    model.train(was_training)
    # how well the routers rank: of the pairs beyond the window the teacher ranks in its top mu_f, the share sent global
    truth = torch.stack([torch.cat(c) for c in costs])  # [layers, far tokens, heads]
    routed = torch.stack([torch.cat([(zb[:, m.cfg.window:] + s > 0).reshape(-1, heads) for zb in rows])
                          for rows, s, m in zip(logits, shifts, layers)])
    top = truth > torch.quantile(_sample(truth.flatten()), 1.0 - mu_f)
    gates = [zl + s > 0 for zl, s in zip(z, shifts)]
    return Teaching(mu_f=sum(g.float().sum().item() for g in gates) / sum(g.numel() for g in gates),
                    layer_mu_f=[g.float().mean().item() for g in gates], head_cost=truth.mean(1).tolist(),
                    recall=((routed & top).sum() / top.sum().clamp_min(1)).item(), tokens=tokens, label=label,
                    budget=budget)


def _sample(x: torch.Tensor, most: int = 1 << 22) -> torch.Tensor:
    """An even subsample of a flat tensor (``torch.quantile`` takes at most 2^24 values)."""
    return x if x.numel() <= most else x[torch.linspace(0, x.numel() - 1, most).long()]


def _shifts(z: list[torch.Tensor], mu_f: float, budget: str) -> list[float]:
    """Per layer the shift of its routers' logits that sends a share ``mu_f`` global (z + shift > 0): each
    layer's own quantile, or one over all layers."""
    if budget == "layer":
        return [-torch.quantile(_sample(zl.flatten()).double(), 1.0 - mu_f).item() for zl in z]
    shift = -torch.quantile(_sample(torch.cat([zl.flatten() for zl in z])).double(), 1.0 - mu_f).item()
    return [shift] * len(z)
