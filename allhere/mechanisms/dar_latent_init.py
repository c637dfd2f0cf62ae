"""Initialising ``dar_latent`` layers from the pretrained host they sit in (our decoder, or a Hugging Face model
converted by ``allhere.hf.convert``): MHA2MLA's recipe ("Towards Economical Inference: Enabling DeepSeek's
Multi-Head Latent Attention in Any Transformer-based LLMs", arXiv:2502.14837).

1. Which rotary pairs stay rotated, per KV head: with calibration text, the ``rope_pairs`` pairs of highest
   2-norm score (mean ||q_f|| x mean ||k_f|| over the calibration tokens, summed over the group's query heads),
   measured while every layer computes the host's own attention. Without, the same score on the weights: a
   pair's norm taken as the Frobenius norm of its two rows of W_Q and W_K (``weight_pair_norms``; our stand-in,
   not MHA2MLA's: on SmolLM2-135M it starts far nearer the host than MHA2MLA's evenly spaced pairs, docs/dar.md);
   evenly spaced pairs only where the host has no ``q_proj``.
2. W_down, W_UK, W_UV: the truncated SVD of the host's [W_K content rows ; W_V] (``svd_init``).

At full rank (every pair kept, d_down >= kv_heads x head_dim) the layer computes exactly what the host computes.
The host's K/V must be plain linear maps ``k_proj`` / ``v_proj`` without bias (our decoder; Llama, Mistral,
Qwen3, OLMo-2 on Hugging Face: k norms are not folded, the SVD then approximates the key before its norm).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..validation import ConfigError
from .dar_latent_channels import (
    channel_order,
    svd_init,
    top_pairs,
    two_norm_scores,
    uniform_pairs,
    weight_pair_norms,
)


def latent_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(host attention module, its ``dar_latent`` mechanism) of every such layer, in layer order (found by the
    kind of its config: the mechanism's module imports this one, so this one does not import it back)."""
    return [(host, child) for host in model.modules() for child in host.children()
            if getattr(getattr(child, "cfg", None), "kind", None) == "dar_latent"]


def calibrate(model: nn.Module, run: Callable[[], object]) -> list[dict]:
    """Call ``run()`` (forward passes of ``model`` over calibration text, without a cache or padding) while every
    ``dar_latent`` layer computes the host's own causal attention and sums each rotary pair's norms of its q and
    k; return those sums per layer (``{"q": [heads, P], "k": [kv_heads, P], "tokens", "rot"}``)."""
    layers = [mech for _, mech in latent_layers(model)]
    if not layers:
        raise ValueError("this model has no dar_latent layers to calibrate")
    for mech in layers:
        mech.calibration = {}
    try:
        with torch.no_grad():
            run()
        stats = [mech.calibration for mech in layers]
    finally:
        for mech in layers:
            mech.calibration = None
    if any("tokens" not in s for s in stats):
        raise ValueError("calibrate: run() made no forward pass through every dar_latent layer")
    return stats


def init_layer(mech: nn.Module, w_k: torch.Tensor, w_v: torch.Tensor, stats: dict | None = None,
               rot: int | None = None, w_q: torch.Tensor | None = None) -> nn.Module:
    """Set one layer from its host's W_K, W_V ([kv_heads * head_dim, d]): kept pairs by the 2-norm score of
    ``stats`` (``calibrate``); else, with the host's W_Q ([heads * head_dim, d]), by the same score on the
    weights' pair norms (``weight_pair_norms``); else evenly spaced; over a rotary width ``rot`` (default: the
    whole head). Then the truncated SVD. In place; returns ``mech``."""
    g, d = mech.channels.shape
    keep = mech.cfg.rope_pairs
    if stats is not None:
        rot = stats["rot"]
        pairs = top_pairs(two_norm_scores(stats["q"], stats["k"], stats["tokens"]), keep)
    elif w_q is not None:
        rot = d if rot is None else rot
        heads = w_q.shape[0] // d
        pairs = top_pairs(two_norm_scores(weight_pair_norms(w_q, heads, rot), weight_pair_norms(w_k, g, rot), 1),
                          keep)
    else:
        rot = d if rot is None else rot
        pairs = uniform_pairs(g, rot // 2, keep)
    if 2 * keep > rot:
        raise ConfigError(f"DARLatentConfig.rope_pairs = {keep} is invalid for this host: its rotary embedding has "
                          f"{rot // 2} pairs per head")
    order = channel_order(pairs, rot, d)
    down, up_k, up_v = svd_init(w_k.detach(), w_v.detach(), order, 2 * keep, mech.cfg.d_down)
    with torch.no_grad():
        for p, value in ((mech.down.weight, down), (mech.up_k.weight, up_k), (mech.up_v.weight, up_v)):
            p.copy_(value.to(p.dtype))
        mech.channels.copy_(order)
    return mech


def host_refusal(host: nn.Module) -> str | None:
    """Why ``host`` (an attention module) cannot initialise a ``dar_latent`` layer, or None: its K/V must be
    plain linear ``k_proj`` / ``v_proj`` without bias."""
    for name in ("k_proj", "v_proj"):
        proj = getattr(host, name, None)
        if not isinstance(proj, nn.Linear) or proj.bias is not None:
            what = "missing" if proj is None else "biased" if isinstance(proj, nn.Linear) else type(proj).__name__
            return (f"{type(host).__name__}: dar_latent initialises from plain linear k_proj / v_proj without bias; "
                    f"this layer's {name} is {what}")
    return None


def init_from_host(model: nn.Module, run: Callable[[], object] | None = None) -> nn.Module:
    """Initialise every ``dar_latent`` layer of ``model`` from its host layer's ``k_proj`` / ``v_proj``, after
    ``calibrate(model, run)`` when ``run`` is given (the 2-norm pair choice), else by the weights' score.
    ConfigError where a host layer's K/V are not plain linear maps. In place; returns ``model``."""
    layers = latent_layers(model)
    if not layers:
        raise ValueError("this model has no dar_latent layers to initialise")
    for host, _ in layers:
        refusal = host_refusal(host)
        if refusal:
            raise ConfigError(refusal)
    stats = calibrate(model, run) if run is not None else [None] * len(layers)
    for (host, mech), s in zip(layers, stats):
        q = getattr(host, "q_proj", None)
        init_layer(mech, host.k_proj.weight, host.v_proj.weight, s, w_q=q.weight if isinstance(q, nn.Linear) else None)
    return model
