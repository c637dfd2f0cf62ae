"""Convert a loaded ``transformers`` causal LM to DAR (seeds/001) in place: every pretrained weight kept,
a bottleneck (W_down, W_up) added to each attention module as its ``dar`` submodule.

Extension points only, no patched ``forward``. A forward pre-hook keeps the attention module's call (its
input h and arguments); the attention function registered under ``allhere_dar`` receives the module's own
near q/k/v and gets the distant K/V by calling the module once more on h' = (h W_down) W_up with no cache:
in that inner call the same attention function only captures the keys and values, so they pass through the
family's own projections, q/k norms (OLMo-2 over all heads, Qwen3 per head), partial rotary (GPT-NeoX)
and grouped-query layout. The inner call's query and output projections are wasted work (about
2 x d^2 multiply-adds per token and layer). A DAR model converted from Hugging Face runs without a KV
cache (training, perplexity, ``generate(use_cache=False)``, the default after conversion); the
compressed inference cache lives in allhere's own decoder (``allhere.mechanisms.dar.DARCache``).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..config import ConfigError, DARConfig
from ..mechanisms.dar import DARAttention
from .convert import attention_modules, check_window, drop_sliding_window, install

ATTN_NAME = "allhere_dar"
_CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past")


class HFDARAttention(DARAttention):
    """DAR bottleneck living inside a Hugging Face attention module."""

    def __init__(self, cfg: DARConfig, d_model: int, n_heads: int) -> None:
        super().__init__(cfg, d_model, n_heads)
        self._call: tuple | None = None
        self._captured: tuple | None = None

    def far_kv(self, module, h: torch.Tensor, args: tuple, kwargs: dict):
        """K/V of h through the attention module's own path (called again on h, without a cache)."""
        kwargs = {k: (None if k in _CACHE_ARGS else v) for k, v in kwargs.items()}
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = h
        else:
            args = (h, *args[1:])
        self._captured = ()  # marks the inner call
        try:
            module(*args, **kwargs)
            k, v = self._captured
        finally:
            self._captured = None
        return k, v


def _stash_call(module, args, kwargs):
    if module.dar._captured is None:  # the outer call (the inner one is made by far_kv)
        module.dar._call = (args, kwargs)


def dar_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          **kwargs):
    """transformers attention-interface signature; returns (output [b, q, h, d], None)."""
    mech = module.dar
    if mech._captured is not None:  # inner call: hand the distant K/V over, the output is not used
        mech._captured = (key, value)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    if dropout:
        raise NotImplementedError("allhere DAR attention does not implement attention dropout; set it to 0")
    if mech._call is None:
        raise RuntimeError("DAR attention called without its input: was the model converted with allhere.hf.convert_dar?")
    (args, call_kwargs), mech._call = mech._call, None
    if key.shape[2] != query.shape[2] or any(call_kwargs.get(k) is not None for k in _CACHE_ARGS):
        raise RuntimeError("a DAR model converted from Hugging Face runs without a KV cache: call it with "
                           "use_cache=False (generate(..., use_cache=False))")
    x = call_kwargs["hidden_states"] if "hidden_states" in call_kwargs else args[0]
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    if mask is not None and mask.dtype != torch.bool:  # additive float mask -> boolean
        mask = mask > torch.finfo(mask.dtype).min / 2
    out, _ = mech(query, key, value, x, kv_of=lambda h: mech.far_kv(module, h, args, call_kwargs), mask=mask,
                  scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def convert_dar(model, cfg: DARConfig):
    """Turn ``model`` (a transformers causal LM of a supported family) into its DAR version, in place.

    W_down starts with orthonormal rows and W_up is its transpose, so with d_down = d (the paper's
    no-bottleneck baseline) or a window covering the whole sequence the converted model computes what
    the original computed. The model's own sliding window, if any, is switched off. Returns the model.
    """
    modules = attention_modules(model)
    check_window(model, cfg.window, "DARConfig.window")
    hidden, heads = model.config.hidden_size, model.config.num_attention_heads
    if cfg.d_down > hidden:
        raise ConfigError(f"DARConfig.d_down = {cfg.d_down} is larger than the model's hidden size ({hidden})")
    AttentionInterface.register(ATTN_NAME, dar_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    install(modules, "dar", lambda: HFDARAttention(cfg, hidden, heads), _stash_call)
    drop_sliding_window(model.config)
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = False
    model.config.allhere_dar = dataclasses.asdict(cfg)
    model.set_attn_implementation(ATTN_NAME)
    return model
