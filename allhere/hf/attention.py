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
hands over; a mechanism with its own cache layer (``allhere.hf.cache.has_own_layer``) also
gets that layer's view of the call as ``cache``.

Sequence boundaries: the registered mask function builds transformers' usual mask once per forward (one
per layer type: full and sliding); the segment starts are read off it (``allhere.masks.segment_starts``)
once, by the first converted layer that needs them (``SegmentMask``). A context-parallel shard
(``SHARD_POSITIONS`` set) gets no mask: its mechanisms run through the ring, which masks by position.

Layers without a mechanism (a hybrid model's sliding-window layers, by default) run the attention
function the model had before conversion (``HOST_IMPL``: SDPA, or the model's own eager function, which
computes gpt-oss's sinks and Gemma-2's soft-capping) on the mask transformers built for them.
"""

from __future__ import annotations

import contextvars
import sys

import torch
from transformers import AttentionInterface
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_masks_for_generate, sdpa_mask

from ..hosts import SUBMODULE
from ..kernels.autotune import capturing
from ..masks import segment_starts
from ..mechanisms.base import AttentionCall
from .cache import own_layer

ATTN_NAME = "allhere"
SOFTMAX_TERMS = ("s_aux", "softcap")  # what hosts pass for softmax terms beyond scaled scores (sinks, capping)
HOST_IMPL = "allhere_host_attention"  # attribute of every attention module: "sdpa" or "eager" for its layer
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # by transformers version and family
# int64 [n]: while set, the model runs a shard of longer sequences at these absolute positions (context
# parallelism, set by ``HFCausalLM``): no mask is built, the mechanisms get the positions and the ring masks.
SHARD_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("allhere_shard_positions", default=None)


class SegmentMask:
    """What the mask function hands every layer: transformers' dense mask (bool [b, 1, q, kv], as built for
    SDPA) and, read off it on first use, its segment starts ([b, q] first key of each query's segment, -1:
    none; None: the mask is not causal attention within segments, e.g. a sliding window)."""

    def __init__(self, dense: torch.Tensor) -> None:
        self.dense = dense
        self._starts: torch.Tensor | None | bool = False  # False: not read yet

    @property
    def starts(self) -> torch.Tensor | None:
        if self._starts is False:
            self._starts = segment_starts(self.dense, self.dense.shape[-2], self.dense.shape[-1])
        return self._starts


def mask_function(*args, **kwargs):
    """transformers mask-interface signature: SDPA's boolean mask (None: plain causal attention; always
    None for a context-parallel shard, whose mask the ring builds from absolute positions)."""
    if SHARD_POSITIONS.get() is not None:
        return None
    dense = sdpa_mask(*args, **kwargs)
    return None if dense is None else SegmentMask(dense)


def unwrap_generate_masks(model) -> None:
    """Have ``model.generate`` hand the forward dense masks where it builds them ahead of a static cache's step
    (its ``create_masks_for_generate``, transformers' or the model's own, wrapped once): the forward takes only a
    tensor (or a dict of them) as a mask already built, and the attention function reads a dense mask as it reads
    a ``SegmentMask``'s."""
    make = getattr(model, "create_masks_for_generate", create_masks_for_generate)
    if getattr(make, "allhere_unwraps", False):
        return

    def dense_masks(*args, **kwargs):
        masks = make(*args, **kwargs)
        if isinstance(masks, dict):
            return {k: m.dense if isinstance(m, SegmentMask) else m for k, m in masks.items()}
        return masks.dense if isinstance(masks, SegmentMask) else masks

    dense_masks.allhere_unwraps = True
    model.create_masks_for_generate = dense_masks


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as the additive float mask the eager attention functions take."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _eager(module):
    """The model family's own eager attention function (it computes sinks and soft-capping)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def host_attention(module, query, key, value, attention_mask, **kwargs):
    """A layer without a mechanism: the attention function the model had (``HOST_IMPL``) on its own mask; the
    family's eager one where SDPA cannot compute the layer's softmax (sinks, soft-capping)."""
    dense = attention_mask.dense if isinstance(attention_mask, SegmentMask) else attention_mask
    plain = all(kwargs.get(k) is None for k in SOFTMAX_TERMS)
    if plain and getattr(module, HOST_IMPL, "sdpa") != "eager":
        return sdpa_attention_forward(module, query, key, value, dense, **kwargs)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if dense is None:  # plain causal: the eager functions take an explicit mask
        j = torch.arange(kv_len, device=query.device)
        dense = (j <= torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len))[None, None]
    return _eager(module)(module, query, key, value, _additive(dense, query.dtype), **kwargs)


def _host_softmax(module, kwargs):
    """``AttentionCall.attend`` for a layer whose softmax has terms of its own (gpt-oss's sink logits in
    ``s_aux``, Gemma-2's ``softcap``): the family's eager function under any bool mask; None for a plain one."""
    if all(kwargs.get(k) is None for k in SOFTMAX_TERMS):
        return None
    eager = _eager(module)

    def attend(q, k, v, allowed):
        allowed = allowed if allowed.dim() == 4 else allowed[None, None]
        out, _ = eager(module, q, k, v, _additive(allowed, q.dtype), **kwargs)
        return out.transpose(1, 2)

    return attend


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
    embedded by the model's rotary module, and handed over as ``position_ids`` where the module takes them;
    a model without rotary embeddings, e.g. GPT-2's learned absolute positions added to the input, has K/V
    that do not depend on the position)."""
    mech = getattr(module, SUBMODULE)
    kwargs = {k: (None if k in _CACHE_ARGS else v) for k, v in kwargs.items()}
    if positions is not None:
        ids = positions.reshape(-1, positions.shape[-1]).long()
        if (rotary is None) != ("position_embeddings" not in kwargs):
            raise NotImplementedError("this Hugging Face host projects K/V only at the positions of the current "
                                      "call (a rotary module without position embeddings passed by keyword, or "
                                      "the other way round)")
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(h, ids)
        if "position_ids" in kwargs:  # hosts that rotate inside the module from position_ids (GPT-J)
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
    mech = getattr(module, SUBMODULE, None)
    if mech is None:
        return host_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # ``dropout``: a converted layer has no attention dropout (``convert`` says so), whatever the host passes
    if mech.hf_captured is not None:  # the inner call of project_kv: hand K/V over, the output is unused
        mech.hf_captured = (key, value)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    if mech.hf_call is None:
        raise RuntimeError("allhere attention called without its input: "
                           "was the model converted with allhere.hf.convert?")
    (args, call_kwargs, rotary), mech.hf_call = mech.hf_call, None
    attend = _host_softmax(module, {**kwargs, "dropout": 0.0, "scaling": scaling})
    if attend is not None and not mech.host_softmax:
        raise NotImplementedError(f"{type(mech).__name__} does not compute this layer's softmax (sinks or "
                                  "soft-capping); convert refuses such layers")
    host_cache = _host_cache(call_kwargs)
    kv_len = static_length(host_cache, module.layer_idx, mech)
    if kv_len is not None:  # a static cache: its whole buffers come in, kv_len[0] tokens of them written
        key, value, attention_mask, kv_len = static_call(query.shape[2], key, value, attention_mask, kv_len)
    starts = None
    if kv_len is not None and isinstance(attention_mask, torch.Tensor):  # a decode query: its first key
        starts = decode_start(attention_mask[:, 0, -1], kv_len)
    elif isinstance(attention_mask, SegmentMask):
        starts = attention_mask.starts
        if starts is None:
            raise NotImplementedError("allhere attention takes causal masks with padding and packed documents; "
                                      "this model built another mask (a static cache or a custom mask function?)")
    elif attention_mask is not None:
        raise NotImplementedError(f"allhere attention got a mask it did not build ({type(attention_mask).__name__})")
    call = AttentionCall(x=_hidden_states(args, call_kwargs), segment_starts=starts, scale=scaling, attend=attend,
                         positions=SHARD_POSITIONS.get(), kv_len=kv_len, rope=_rope(call_kwargs),
                         project_kv=lambda h, positions=None: project_kv(module, args, call_kwargs, rotary, h,
                                                                         positions))
    cache = None
    if host_cache is not None and kv_len is None:
        layer = own_layer(host_cache, module.layer_idx, mech, query.shape[2], key, value)
        cache = None if layer is None else layer.for_call(call_kwargs.get("position_ids"))
    out, routing = mech(query, key, value, call, cache=cache)
    mech.last_routing = routing
    return out.transpose(1, 2).contiguous(), None


def _rope(call_kwargs):
    """(cos, sin) of the call's queries where the module was handed them (``position_embeddings``, rotate-half
    families: Llama, Qwen, Mistral, OLMo-2, GPT-NeoX's partial rotary), else None."""
    rope = call_kwargs.get("position_embeddings")
    return tuple(rope) if isinstance(rope, (tuple, list)) and len(rope) == 2 else None


def static_length(host_cache, layer_idx: int, mech) -> torch.Tensor | None:
    """The device count of tokens a static cache layer (transformers' ``StaticLayer``, e.g. of
    ``StaticCache``: whole buffers handed over, written in place) holds after this call's update, else None.
    Raises where the layer's mechanism cannot read such buffers or the layer slides."""
    layers = getattr(host_cache, "layers", None)
    layer = None if layers is None else layers[layer_idx]
    if not isinstance(layer, StaticLayer):
        return None
    length = getattr(layer, "cumulative_length", None)
    why = (None if mech.takes_kv_len else f"{type(mech).__name__} does not decode over a static cache's buffers")
    if why is None and (layer.is_sliding or not torch.is_tensor(length)):
        why = ("a sliding static layer" if layer.is_sliding
               else "this transformers version's StaticLayer keeps no device count (cumulative_length)")
    if why is not None:
        raise NotImplementedError(f"allhere attention with a static cache: {why}; use the default cache or "
                                  "allhere.hf.new_cache(model)")
    return length


def static_call(q_len: int, key, value, attention_mask, length: torch.Tensor):
    """(key, value, mask, kv_len) of a call of ``q_len`` queries over a static cache's whole buffers: a decode
    query gets kv_len (each sequence's count, read on the device) and its mask row as a dense tensor; a longer
    call (an eager prefill) gets the written keys only, its mask cut to them, and no kv_len (one host read of
    the count per layer)."""
    dense = attention_mask.dense if isinstance(attention_mask, SegmentMask) else attention_mask
    if q_len == 1:
        return key, value, dense, length.to(torch.int32).expand(key.shape[0])
    n = int(length)
    return key[:, :, :n], value[:, :, :n], None if dense is None else SegmentMask(dense[..., :n]), None


def decode_start(row: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """[b, 1] the first key of each decode query over a static cache, from its mask row (bool [b, buffer]),
    where the row allows exactly the keys from it to the query (padding before them, nothing after). A row
    that is not so (a hole, no key) is refused; while a CUDA graph is captured or torch.compile traces, where no
    check can be read back, it gets -1 (zero output) instead of a wrong answer."""
    first = row.to(torch.uint8).argmax(-1)
    exact = row.sum(-1) == kv_len - first
    if not capturing() and not torch.compiler.is_compiling() and not bool(exact.all()):
        raise NotImplementedError("allhere attention over a static cache takes left padding only (each row's keys "
                                  "one run up to the query); this mask has holes or rows without keys")
    return torch.where(exact, first, -1)[:, None]


def register() -> None:
    """Idempotent: make ``attn_implementation="allhere"`` known to transformers."""
    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, mask_function)
