"""Convert a loaded ``transformers`` causal LM to AHA in place: every pretrained weight kept, a router added.

Extension points only, no patched ``forward``: each attention module gets an ``aha`` submodule (the
router and the AHA mechanism) and a forward pre-hook that hands the module's input X to the router; the
model switches to the attention function and mask function registered under ``allhere_aha``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import AHAConfig, ConfigError
from ..mechanisms.aha import AHAAttention
from ..routing import Routing
from .attention import ATTN_NAME, register

# model_type -> (path of the decoder layers, name of the attention module in a layer)
SUPPORTED_MODEL_TYPES = {
    "llama": ("model.layers", "self_attn"),
    "mistral": ("model.layers", "self_attn"),
    "qwen2": ("model.layers", "self_attn"),
    "qwen3": ("model.layers", "self_attn"),
    "olmo2": ("model.layers", "self_attn"),
    "gpt_neox": ("gpt_neox.layers", "attention"),
}


class HFAHAAttention(AHAAttention):
    """AHA mechanism living inside a Hugging Face attention module."""

    def __init__(self, cfg: AHAConfig, d_model: int, n_heads: int) -> None:
        super().__init__(cfg, d_model, n_heads)
        self._input: torch.Tensor | None = None
        self.last_routing = None

    def stash_input(self, x: torch.Tensor) -> None:
        self._input = x

    def pop_input(self) -> torch.Tensor:
        x, self._input = self._input, None
        if x is None:
            raise RuntimeError("AHA attention called without its input: was the model converted with allhere.hf.convert?")
        return x


def _stash_input(module, args, kwargs):
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module.aha.stash_input(x)


def attention_modules(model) -> list[torch.nn.Module]:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported architecture {model_type!r}: allhere converts "
                          f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    path, attr = SUPPORTED_MODEL_TYPES[model_type]
    layers = model
    for part in path.split("."):
        layers = getattr(layers, part)
    return [getattr(layer, attr) for layer in layers]


def check_window(model, window: int, field: str) -> None:
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and window > context:
        raise ConfigError(f"{field} = {window} is larger than the model's context "
                          f"(max_position_embeddings = {context})")


def install(modules, name: str, build, pre_hook) -> None:
    """Give every attention module a mechanism submodule ``name`` (``build()``, on the module's device
    and dtype) and a forward pre-hook (with kwargs) that hands it the call."""
    for attn in modules:
        if hasattr(attn, "aha") or hasattr(attn, "dar"):
            raise ValueError("this model is already converted (it has AHA or DAR layers)")
    for attn in modules:
        ref = next(attn.parameters())
        setattr(attn, name, build().to(device=ref.device, dtype=ref.dtype))
        attn.register_forward_pre_hook(pre_hook, with_kwargs=True)


def drop_sliding_window(config) -> None:
    """A converted model attends over the whole prefix: switch the family's own sliding window off."""
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    if getattr(config, "use_sliding_window", False):
        config.use_sliding_window = False


def convert(model, cfg: AHAConfig):
    """Turn ``model`` (a transformers causal LM of a supported family) into its AHA version, in place.

    The router starts as ``cfg.router_init`` says ("global" by default: the converted model computes
    what the original computed). A sliding window the original config may carry is switched off: the
    global path of AHA is full causal attention. Returns the model.
    """
    if cfg.router != "linear":
        raise ConfigError("AHAConfig.router = 'qproj' is not supported for Hugging Face models (it would "
                          "change q_proj's shape); use router='linear'")
    modules = attention_modules(model)
    check_window(model, cfg.window, "AHAConfig.window")
    register()
    hidden, heads = model.config.hidden_size, model.config.num_attention_heads
    install(modules, "aha", lambda: HFAHAAttention(cfg, hidden, heads), _stash_input)
    drop_sliding_window(model.config)
    model.config.allhere_aha = dataclasses.asdict(cfg)
    model.set_attn_implementation(ATTN_NAME)
    return model


def _mechanisms(model) -> list[HFAHAAttention]:
    mechs = [attn.aha for attn in attention_modules(model) if hasattr(attn, "aha")]
    if not mechs:
        raise ValueError("this model has no AHA layers: convert it with allhere.hf.convert first")
    return mechs


def collect_routing(model) -> Routing:
    """The routing of the model's last forward pass (scores and gates of every layer)."""
    mechs = _mechanisms(model)
    return Routing(list(range(len(mechs))), [m.last_routing for m in mechs])


def set_forced_gate(model, value: bool | None) -> None:
    """Force every gate to full (True) or local (False) attention; None restores routing."""
    for m in _mechanisms(model):
        m.forced_gate = value
