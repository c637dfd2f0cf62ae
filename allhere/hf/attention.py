"""The attention function and mask function allhere registers with ``transformers`` (name ``allhere``).

The model's own attention module projects q/k/v, applies its own normalisation and rotary embedding
(OLMo-2's q/k norm over all heads, GPT-NeoX's partial rotary, grouped-query heads) and updates the KV
cache; then it calls ``attention_forward`` with the post-RoPE query [b, h, q, d] and the cached keys /
values [b, kv_heads, kv, d]. The mechanism installed as the module's ``allhere`` submodule decides what
each query reads. A forward pre-hook keeps the module's call, which gives the mechanism its input X
(``AttentionCall.x``) and, for mechanisms that need K/V of other inputs (DAR), the module's own K/V
path: the module is called once more on those inputs, and in that inner call the attention function
only captures the keys and values. At other positions than the call's (cached tokens), the inner call
gets the rotary embedding of those positions from the model's own rotary module, which ``convert``
hands the pre-hook.

KV cache: mechanisms that decode with transformers' own layers (every key kept) read the keys the module
hands over; a mechanism with its own cache layer (``new_hf_cache_layer``, see ``allhere.hf.cache``) also
gets that layer's view of the call as ``cache``.

Sequence boundaries: the registered mask function builds transformers' usual mask once per forward and
reads the segment starts off it there (``allhere.masks.segment_starts``); every layer then gets them as
an explicit argument (``SegmentMask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..masks import segment_starts
from ..mechanisms.base import AttentionCall
from .cache import own_layer

ATTN_NAME = "allhere"
SUBMODULE = "allhere"  # the mechanism's name inside the attention module
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # by transformers version and family


@dataclass
class SegmentMask:
    """What the mask function hands every layer: transformers' dense mask and its segment starts."""

    dense: torch.Tensor  # bool [b, 1, q, kv] as transformers builds it for SDPA
    starts: torch.Tensor | None  # [b, q] first key of each query's segment (-1: none); None: not segments


def mask_function(*args, **kwargs):
    """transformers mask-interface signature: SDPA's boolean mask, converted once into segment starts."""
    dense = sdpa_mask(*args, **kwargs)
    if dense is None:  # plain causal attention
        return None
    return SegmentMask(dense, segment_starts(dense, dense.shape[-2], dense.shape[-1]))


def stash_call(module, args, kwargs, rotary=None):
    """Forward pre-hook (``rotary``: the model's rotary embedding module, bound by ``convert``): keep the
    outer call (the inner K/V call is made by ``project_kv``)."""
    mech = getattr(module, SUBMODULE)
    if mech.hf_captured is None:
        mech.hf_call = (args, kwargs, rotary)


def _hidden_states(args, kwargs):
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _host_cache(kwargs):
    """The transformers cache the module was called with (its argument name differs by family), or None."""
    return next((kwargs[k] for k in _CACHE_ARGS if kwargs.get(k) is not None), None)


def project_kv(module, args, kwargs, rotary, h: torch.Tensor, positions=None):
    """K/V of ``h`` [b, n, d] through the attention module's own path (called again on h, without a
    cache), at the positions of the current call, or at ``positions`` ([n] or [b, n]: rotary positions,
    embedded by the model's rotary module)."""
    mech = getattr(module, SUBMODULE)
    kwargs = {k: (None if k in _CACHE_ARGS else v) for k, v in kwargs.items()}
    if positions is not None:
        if rotary is None or "position_embeddings" not in kwargs:
            raise NotImplementedError("this Hugging Face host projects K/V only at the positions of the current "
                                      "call (no rotary module, or position embeddings not passed by keyword)")
        ids = positions.reshape(-1, positions.shape[-1]).long()
        kwargs["position_embeddings"] = rotary(h, ids)
        kwargs["position_ids"] = ids
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = h
    else:
        args = (h, *args[1:])
    mech.hf_captured = ()  # marks the inner call
    try:
        module(*args, **kwargs)
        k, v = mech.hf_captured
    finally:
        mech.hf_captured = None
    return k, v


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention-interface signature; returns (output [b, q, h, d], None)."""
    mech = getattr(module, SUBMODULE)
    if mech.hf_captured is not None:  # the inner call of project_kv: hand K/V over, the output is unused
        mech.hf_captured = (key, value)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    if dropout:
        raise NotImplementedError("allhere attention does not implement attention dropout; set it to 0")
    if mech.hf_call is None:
        raise RuntimeError("allhere attention called without its input: was the model converted with allhere.hf.convert?")
    (args, call_kwargs, rotary), mech.hf_call = mech.hf_call, None
    starts = None
    if isinstance(attention_mask, SegmentMask):
        starts = attention_mask.starts
        if starts is None:
            raise NotImplementedError("allhere attention takes causal masks with padding and packed documents; "
                                      "this model built another mask (a static cache or a custom mask function?)")
    elif attention_mask is not None:
        raise NotImplementedError(f"allhere attention got a mask it did not build ({type(attention_mask).__name__})")
    call = AttentionCall(x=_hidden_states(args, call_kwargs), segment_starts=starts, scale=scaling,
                         project_kv=lambda h, positions=None: project_kv(module, args, call_kwargs, rotary, h,
                                                                         positions))
    host_cache, cache = _host_cache(call_kwargs), None
    if host_cache is not None:
        layer = own_layer(host_cache, module.layer_idx, mech, query.shape[2], key, value)
        cache = None if layer is None else layer.for_call(call_kwargs.get("position_ids"))
    out, routing = mech(query, key, value, call, cache=cache)
    mech.last_routing = routing
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Idempotent: make ``attn_implementation="allhere"`` known to transformers."""
    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, mask_function)
