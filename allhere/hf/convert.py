"""Convert a loaded ``transformers`` causal LM to any registered mechanism, in place: every pretrained
weight kept, the mechanism's own weights (routers, bottlenecks) added.

Extension points only, no patched ``forward``: each attention module gets the mechanism as its
``allhere`` submodule and a forward pre-hook that hands it the call; the model switches to the attention
function and mask function registered under ``allhere`` (``allhere.hf.attention``).
"""

from __future__ import annotations

from functools import partial

import torch

from .. import registry
from ..mechanisms.base import AttentionDims, mechanism_layers
from ..routing import Routing, routed_layers
from ..validation import ConfigError
from .attention import ATTN_NAME, SUBMODULE, register, stash_call

CONFIG_KEY = "allhere_mechanism"  # config.json entry holding the mechanism's settings

# model_type -> (path of the decoder layers, name of the attention module in a layer)
SUPPORTED_MODEL_TYPES = {
    "llama": ("model.layers", "self_attn"),
    "mistral": ("model.layers", "self_attn"),
    "qwen2": ("model.layers", "self_attn"),
    "qwen3": ("model.layers", "self_attn"),
    "olmo2": ("model.layers", "self_attn"),
    "gpt_neox": ("gpt_neox.layers", "attention"),
}


def _at(model, path: str):
    for part in path.split("."):
        model = getattr(model, part)
    return model


def attention_modules(model) -> list[torch.nn.Module]:
    check_convertible(model.config)
    path, attr = SUPPORTED_MODEL_TYPES[model.config.model_type]
    return [getattr(layer, attr) for layer in _at(model, path)]


def rotary_module(model):
    """The model's rotary embedding module (``rotary_emb`` beside the decoder layers), or None."""
    path = SUPPORTED_MODEL_TYPES[model.config.model_type][0]
    return getattr(_at(model, path.rpartition(".")[0]), "rotary_emb", None)


def dims_of(config) -> AttentionDims:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionDims(config.hidden_size, heads, getattr(config, "num_key_value_heads", None) or heads, head_dim)


def rope_types(config) -> set[str]:
    """The rotary types a transformers config asks for (one per layer type where it has several)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    groups = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return {g.get("rope_type", g.get("type", "default")) or "default" for g in groups}


def check_rope(config) -> None:
    """Refuse (ConfigError) a rotary type transformers does not implement: the model could not be built."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    unknown = sorted(t for t in rope_types(config) if t != "default" and t not in ROPE_INIT_FUNCTIONS)
    if unknown:
        raise ConfigError(f"config.json asks for rope_type {', '.join(map(repr, unknown))}, which this transformers "
                          f"does not implement (it knows default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")


LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}  # rotary frequencies that change with the sequence length


def check_convertible(config, cfg=None) -> None:
    """Refuse (ConfigError, one line naming the flag) what ``convert`` would compute differently from the
    original: an unsupported family, layers that are not all full attention (a hybrid of sliding and full
    layers: ``layer_types``, or Qwen2/Qwen3's ``use_sliding_window``), an unknown rope type, and for a
    mechanism that rebuilds keys of earlier tokens at their own positions (DAR's compressed cache) a rotary
    embedding whose frequencies change with the sequence length."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported architecture {model_type!r}: allhere converts "
                          f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    check_rope(config)
    kinds = list(getattr(config, "layer_types", None) or [])
    local = [i for i, k in enumerate(kinds) if k != "full_attention"]
    if local:
        why = (f"use_sliding_window = true with max_window_layers = {config.max_window_layers}"
               if getattr(config, "use_sliding_window", False) else "layer_types")
        raise ConfigError(f"config.json: {why} gives layer(s) {', '.join(map(str, local[:4]))}"
                          f"{', ...' if len(local) > 4 else ''} {kinds[local[0]]!r} instead of full attention; "
                          "allhere converts models whose every layer attends to the whole prefix")
    if cfg is not None and hasattr(registry.of(cfg).module, "new_hf_cache_layer"):
        dynamic = rope_types(config) & LENGTH_DEPENDENT_ROPE
        if dynamic:
            raise ConfigError(f"config.json: rope_type {dynamic.pop()!r} changes the rotary frequencies with the "
                              f"sequence length; {type(cfg).__name__} rebuilds earlier keys at their own positions "
                              "and would rotate them with other frequencies than the original did")


def replaced_window(config) -> str | None:
    """What a user should know when the original model has a sliding window of its own (Mistral-7B-v0.1:
    4096) that ``convert`` replaces by the mechanism, or None."""
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None)
    if window is None or (context is not None and window >= context):
        return None
    return (f"note: the model's own sliding_window = {window} is replaced by the mechanism: global attention "
            f"reads the whole prefix, which is the original's attention up to {window} tokens only")


def _check_window(model, cfg) -> None:
    window = getattr(cfg, "window", None)
    context = getattr(model.config, "max_position_embeddings", None)
    if window is not None and context is not None and window > context:
        raise ConfigError(f"{type(cfg).__name__}.window = {window} is larger than the model's context "
                          f"(max_position_embeddings = {context})")


def convert(model, cfg):
    """Turn ``model`` (a transformers causal LM of a supported family) into its version with mechanism
    ``cfg`` (any registered config: ``AHAConfig``, ``DARConfig``, ...), in place; returns the model.

    The mechanism's own weights start as it initialises them: AHA's "global" router init (the default)
    and DAR's orthonormal bottleneck with d_down = d make the converted model compute what the original
    computed. A sliding window the original config may carry is switched off: the mechanism decides what
    each query reads.

    KV cache: transformers' own (every key kept) for mechanisms that decode with it; a mechanism with its
    own cache layer (``new_hf_cache_layer``: DAR's compressed cache) gets it inside transformers' Cache
    (``allhere.hf.cache``), ``generate`` included; ``use_cache`` is switched off only for a mechanism
    that has neither.
    """
    entry = registry.of(cfg)
    check_convertible(model.config, cfg)
    modules = attention_modules(model)
    if any(hasattr(attn, SUBMODULE) for attn in modules):
        raise ValueError("this model is already converted (its attention modules hold allhere mechanisms)")
    _check_window(model, cfg)
    dims = dims_of(model.config)
    built = [entry.module(cfg, dims) for _ in modules]
    if not entry.module.hf_support or built[0].q_extra_rows is not None:
        raise ConfigError(f"mechanism {cfg!r} cannot live in a Hugging Face attention module"
                          + (" (router='qproj' would change q_proj's shape; use router='linear')"
                             if built[0].q_extra_rows is not None else ""))
    register()
    hook = partial(stash_call, rotary=rotary_module(model))  # K/V at other positions need the model's rotary
    for attn, mech in zip(modules, built):
        ref = next(attn.parameters())
        mech.to(device=ref.device, dtype=ref.dtype)
        mech.hf_call = mech.hf_captured = mech.last_routing = None
        attn.add_module(SUBMODULE, mech)
        attn.register_forward_pre_hook(hook, with_kwargs=True)
    config = model.config
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    if getattr(config, "use_sliding_window", False):
        config.use_sliding_window = False
    if not entry.module.hf_cache and not hasattr(entry.module, "new_hf_cache_layer"):  # no cache it could use
        config.use_cache = False
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.use_cache = False
    setattr(config, CONFIG_KEY, registry.to_dict(cfg))
    model.set_attn_implementation(ATTN_NAME)
    return model


def converted_mechanism(model):
    """The mechanism config a converted model carries (its config.json settings), or None."""
    settings = getattr(model.config, CONFIG_KEY, None)
    return None if settings is None else registry.from_dict(settings)


def collect_routing(model) -> Routing:
    """The routing of the model's last forward pass (scores and gates of every routed layer)."""
    layers = routed_layers(model)
    if not layers or not mechanism_layers(model):
        raise ValueError("this model has no routed layers: convert it with allhere.hf.convert and an AHAConfig")
    return Routing([i for i, _ in layers], [m.last_routing for _, m in layers])
