"""Routers taught by the full model: AHA's routers set from the model's own attention, with no fine-tuning.

With the weights as they are and every gate global, the model reads calibration text; for every (token, head) of
every AHA layer the teacher measures what reading locally would cost (``labels.local_cost``: how far the head's
output moves, or the attention mass it would lose); each layer's router is fitted to that cost from its own
input (``fit.fit_router``); then each layer's router bias is shifted so that a share ``mu_f`` of its calibration
(token, head) pairs goes global (every layer gets the budget: per-token choices by the teacher's own cost keep more
of SmolLM2-135M's quality under a per-layer budget than under one over the whole model, 98.5% against 97.3% at
10%, docs/real-model.md). One pass over the text, no gradients through the model.

The methods that make local/global choices work on a pretrained model with little compute learn the gates
against the full model itself, not from the language-model loss alone: DuoAttention (arXiv:2410.10819),
SeerAttention (arXiv:2410.13276). Here the gate stays AHA's per (token, head) and the teacher's signal is per
(token, head) too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..routing import routed_layers, set_forced_gate
from ..validation import ConfigError
from .fit import ANSWER_WEIGHT, even_sample, fit_router
from .labels import LABELS, local_cost
from .observe import observe_routed

MAX_TOKENS = 32768  # positions per layer kept for the fit


@dataclass
class Teaching:
    """What a teaching pass found: per routed layer the share of calibration pairs its router sends global, per
    (layer, head) the teacher's mean cost (static heads at the same budget rank by it) and how well the routers
    rank the pairs they were taught on."""

    mu_f: float  # the share of calibration (token, head) pairs global after teaching
    layer_mu_f: list[float]  # per routed layer
    head_cost: list[list[float]]  # [layers][heads]: the teacher's mean cost per head, beyond the window
    recall: float  # of each layer's costliest ``mu_f`` pairs beyond the window, the share its router sends global
    answer_mu_f: float | None  # the share of pairs global at the positions that answer a planted fact
    tokens: int  # calibration tokens read
    label: str


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


def teach_routers(model, batches: list[torch.Tensor], mu_f: float, answers: list[torch.Tensor] | None = None,
                  label: str = "output", max_tokens: int = MAX_TOKENS,
                  done: Callable[[], None] | None = None) -> Teaching:
    """Teach every AHA router of ``model`` (our ``Decoder`` or a converted transformers model) from the model's own
    attention on ``batches`` (token ids [b, n] each, whole sequences, no padding), and set each layer's biases so
    that a share ``mu_f`` of its calibration (token, head) pairs is global. ``answers``: per batch a bool [b, n] of
    the positions that answer a planted fact (``retrieval.retrieval_windows(..., with_answers=True)``), weighted up
    in the fit. ``label``: ``labels.LABELS`` ("output", the default, was chosen by measurement: docs/real-model.md).
    At most ``max_tokens`` positions per layer are kept for the fit (evenly spaced ones of longer text), in
    bfloat16: about max_tokens x d_model x 2 bytes per layer. ``done()`` is called after each batch. One forward
    pass per batch with every gate global, no gradients through the model. Returns a ``Teaching``."""
    return teach_alike([model], batches, mu_f, answers, label, max_tokens, done)[0]


def teach_alike(models: list, batches: list[torch.Tensor], mu_f: float, answers: list[torch.Tensor] | None = None,
                label: str = "output", max_tokens: int = MAX_TOKENS,
                done: Callable[[], None] | None = None) -> list[Teaching]:
    """``teach_routers`` for several converted copies of one model's weights whose AHA layers may differ in window
    and sinks (a model's routers with and without sinks, say), from one pass: with every gate global they read the
    same inputs, so the first model's forward teaches them all, each from what reading locally costs under its own
    window and sinks. Their weights outside the routed layers must be equal (ConfigError otherwise). One
    ``Teaching`` per model, in order."""
    if not (isinstance(mu_f, (int, float)) and not isinstance(mu_f, bool) and 0.0 < mu_f < 1.0):
        raise ConfigError(f"teaching routers: mu_f = {mu_f!r} is invalid: expected a number strictly between 0 and 1")
    if label not in LABELS:
        raise ConfigError(f"teaching routers: label must be one of {LABELS}, got {label!r}")
    if answers is not None and [a.shape for a in answers] != [b.shape for b in batches]:
        raise ConfigError("teaching routers: answers must be one bool tensor per batch, of the batch's shape")
    layers = [_check(m) for m in models]
    _check_alike(models, layers)
    total = sum(ids.numel() for ids in batches)
    stride = max(1, -(-total // max_tokens))
    kept: list[dict[str, list]] = [{"x": [], "pos": [], "answer": [], "cost": [[] for _ in models]}
                                   for _ in layers[0]]
    seen = {"batch": 0}

    def observe(row, mech, q, k, v, call):
        if call.segment_starts is not None:
            raise ConfigError("teaching routers: calibration batches must be whole sequences (no padding)")
        pick = slice(None, None, stride)
        part = kept[row]
        costs = {}  # (window, sinks) -> cost [b * n, heads], once per kind of local read
        for i, own in enumerate(layers):
            cfg = own[row].cfg
            if (cfg.window, cfg.sinks) not in costs:
                cost = local_cost(q, k, v, cfg.window, cfg.sinks, call.scale, label).transpose(1, 2)  # [b, n, h]
                costs[cfg.window, cfg.sinks] = cost.reshape(-1, cost.shape[-1])[pick].cpu()
            part["cost"][i].append(costs[cfg.window, cfg.sinks])
        b, n = q.shape[0], q.shape[2]
        ans = torch.zeros(b, n, dtype=torch.bool) if answers is None else answers[seen["batch"]].bool().cpu()
        part["x"].append(call.x.detach().reshape(-1, call.x.shape[-1])[pick].to(torch.bfloat16).cpu())
        part["pos"].append(torch.arange(n).expand(b, n).reshape(-1)[pick])
        part["answer"].append(ans.reshape(-1)[pick])
        if row == len(layers[0]) - 1:
            seen["batch"] += 1
            if done is not None:
                done()

    model = models[0]
    was_training = model.training
    model.eval()
    try:
        _pass(model, batches, observe)
    finally:
        model.train(was_training)
    shared = [(torch.cat(p["x"]).float(), torch.cat(p["pos"]), torch.cat(p["answer"])) for p in kept]
    return [_fit(own, shared, [torch.cat(p["cost"][i]) for p in kept], mu_f, total, label)
            for i, own in enumerate(layers)]


def _check_alike(models: list, layers: list[list]) -> None:
    """ConfigError unless ``models`` have routed layers of the same shapes and equal weights outside them."""
    first = models[0]
    routed = {id(p) for m in layers[0] for p in m.parameters()}
    shapes = [_router(m)[0].shape for m in layers[0]]
    for model, own in zip(models[1:], layers[1:]):
        if [_router(m)[0].shape for m in own] != shapes:
            raise ConfigError("teaching routers together: the models' routed layers differ")
        theirs = dict(model.named_parameters())
        for name, p in first.named_parameters():
            if id(p) not in routed and (name not in theirs or not torch.equal(p, theirs[name])):
                raise ConfigError(f"teaching routers together: the models' weights differ ({name})")


def _fit(layers: list, shared: list, costs: list, mu_f: float, total: int, label: str) -> Teaching:
    """One model's routers fitted to its layers' costs (``shared``: per layer the inputs, positions and answer
    marks of the kept pairs) and their biases set to the budget."""
    layer_mu, recall_hits, recall_total, heads_cost, ans_gates = [], 0, 0, [], []
    for mech, (x, pos, ans), cost in zip(layers, shared, costs):
        far = pos >= mech.cfg.window  # before it the whole prefix is local
        far_cost = cost[far]  # the pairs beyond the window: the ones the fit and the recall are about
        weight = 1.0 + (ANSWER_WEIGHT - 1.0) * ans[far].float()
        w, b = fit_router(x[far], far_cost, mu_f, weight, answers=ans[far])
        z = x @ w.T + b
        shift = -torch.quantile(even_sample(z.flatten()).double(), 1.0 - mu_f).item()
        weight_p, bias_p = _router(mech)
        weight_p.data.copy_(w.to(weight_p))
        bias_p.data.copy_((b + shift + math.log(mech.cfg.tau / (1.0 - mech.cfg.tau))).to(bias_p))  # gate: s > tau
        gate = z + shift > 0
        layer_mu.append(gate.float().mean().item())
        top = far_cost > torch.quantile(even_sample(far_cost.flatten()), 1.0 - mu_f)
        recall_hits += (gate[far] & top).sum().item()
        recall_total += top.sum().item()
        heads_cost.append(far_cost.mean(0).tolist())
        ans_gates.append(gate[ans])
    answered = torch.cat(ans_gates)
    return Teaching(mu_f=sum(layer_mu) / len(layer_mu), layer_mu_f=layer_mu, head_cost=heads_cost,
                    recall=recall_hits / max(1, recall_total),
                    answer_mu_f=answered.float().mean().item() if answered.numel() else None, tokens=total,
                    label=label)


@torch.no_grad()
def _pass(model, batches: Iterable[torch.Tensor], fn: Callable) -> None:
    """Every batch through ``model`` with every gate global, ``fn(row, mech, q, k, v, call)`` per routed layer."""
    set_forced_gate(model, True)
    try:
        with observe_routed(model, fn):
            for ids in batches:
                model(ids)
    finally:
        set_forced_gate(model, None)
