"""KV caches of converted Hugging Face models, through transformers' Cache API.

Every converted layer decodes with a cache written in place (``allhere.mechanisms.caches``): a mechanism
that keeps every key (full attention, AHA, sliding window and sinks, which mask what they read) gets
``InPlaceLayer``, transformers' ``DynamicLayer`` with a buffer that doubles when full instead of a
concatenation of the whole cache at every token. A mechanism whose cache is not transformers' every-key
``DynamicLayer`` (``hf_cache = False``; DAR keeps full K/V of the last ``window`` tokens and a d_down latent
per token) decodes with a transformers cache layer (``CacheLayerMixin``) of its own: this host's
(``OWN_LAYERS``, by kind: the mechanisms import no host), or the one a mechanism defined outside allhere
makes itself (``new_hf_cache_layer()``). The attention module updates it itself (``past_key_values.update``,
before the attention function) and its ``for_call(position_ids)`` gives what the mechanism decodes with
(its ``forward(..., cache=)``).

Where such layers come from:

- ``generate`` and a forward with ``use_cache=True`` build transformers' own ``DynamicCache``; each
  converted layer's ``DynamicLayer`` that was empty before the call is replaced by the mechanism's layer
  (or ``InPlaceLayer``) on the first forward (``own_layer``), so the cache a converted model returns,
  and decodes with, is the compressed / in-place one. No ``generate`` or ``forward`` is patched; the one
  transient cost: the prompt's K/V of one layer are copied once more on the first call. Layers left
  unconverted (a hybrid's sliding layers) keep transformers' own.
- ``new_cache(model)`` builds the cache up front (hand it on with ``**cache_kwargs(cache)``: ``cache=``
  where transformers has renamed ``past_key_values``, which then warns).

A cache that already holds every key of earlier calls (a ``DynamicCache`` filled by another model) is
refused with an error: its keys carry no latents to rebuild distant K/V from.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..mechanisms.base import mechanism_layers
from ..mechanisms.caches import GrowingTensor, KVCache, RollingKVCache, storage_bytes, view_bytes


class BufferRows:
    """Beam search, batch selection and offloading for a cache layer whose tensors live in allhere's
    buffers: each applies a function to the batch rows of every buffer (the layer's ``_per_row``)."""

    def _per_row(self, pick) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._per_row(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._per_row(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._per_row(lambda t: t[indices, ...])

    def offload(self) -> None:
        self._per_row(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.keys is not None and self.keys.device != self.device:
            self._per_row(lambda t: t.to(self.device, non_blocking=True))


class InPlaceLayer(BufferRows, DynamicLayer):
    """transformers' ``DynamicLayer`` (every key and value kept, [b, kv_heads, tokens, d]) written in place:
    a ``KVCache`` whose buffers double when full, so a decode step copies its own token, not the whole
    cache. ``keys`` / ``values`` are views of the used part, valid until the layer's next update (the rule
    of ``allhere.mechanisms.caches``); while autograd records, it concatenates as ``DynamicLayer`` does."""

    def __init__(self) -> None:
        super().__init__()
        self._kv = KVCache()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self._kv.update(key_states, value_states)
        return self.keys, self.values

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` tokens in all (prompt + new tokens): one allocation, where a buffer filled by
        the prompt would double at the first new token."""
        self._kv.reserve(tokens)

    def nbytes(self) -> int:
        return self._kv.nbytes()

    def used_nbytes(self) -> int:
        return self._kv.used_nbytes()

    def _per_row(self, pick) -> None:
        self._kv.map_rows(pick)
        if self.is_initialized:
            self.keys, self.values = self._kv.k, self._kv.v

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # checks the argument, crops the views
        if self.is_initialized and self.keys is not None:
            self._kv.truncate(self.keys.shape[-2])

    def reset(self) -> None:
        self._kv = KVCache()
        super().reset()


class DARCacheLayer(BufferRows, DynamicLayer):
    """One DAR layer's cache: ``keys`` / ``values`` hold the full K/V of the last ``window`` tokens (a rolling
    buffer), ``latent`` [b, tokens, d_down] and ``positions`` [b, tokens] (int32, the rotary position of
    each token, per row: left padding shifts them) of every token.

    Written in place (``allhere.mechanisms.caches``): the window lives in a buffer of ``window + slack``
    tokens, the latents and positions in buffers that double their capacity when full, so a decode step
    copies its own token only. ``keys``, ``values``, ``latent``, ``positions`` are views of the used parts,
    and what ``update`` returns is valid until the layer's next update. ``nbytes()`` counts the buffers'
    storage (capacity), ``used_nbytes()`` the tokens kept.

    Trade-off: per token d_down numbers (+ one int32) instead of 2 x kv_heads x head_dim. In exchange, at
    every call the distant K/V of every cached token are rebuilt, one layer at a time: h' = c W_up
    (d_down x d multiply-adds per token), then the attention module runs whole on h' at the tokens' own
    positions (its q/k norms, partial rotary, biases included; its query and output projections too,
    since the module is called as it is), where a full cache only reads. Absorbing W_up into W_K / W_V,
    as ``DARCache`` does for our own decoder, is not possible through a module with k norms."""

    is_croppable = False  # dropped full K/V cannot come back

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.cumulative_length = 0  # tokens seen (zeroed by ``reset``)
        self._near = RollingKVCache(window)
        self._latent, self._positions = GrowingTensor(1), GrowingTensor(1)

    latent = property(lambda self: self._latent.view())  # [b, tokens, d_down]
    positions = property(lambda self: self._positions.view())  # int32 [b, tokens]

    def update(self, key_states, value_states, *args, **kwargs):
        """Return the kept keys/values followed by the new ones (contiguous positions, the last ones), then
        keep the last ``window``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys, values = self._near.update(key_states, value_states)
        self.keys, self.values = self._near.k, self._near.v
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def add_latents(self, latent: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Append this call's latents [b, n, d_down] at ``position_ids`` ([1 or b, n]; None: after the
        cached tokens); return every latent."""
        b, n, _ = latent.shape
        if position_ids is None:
            seen = self._latent.length
            position_ids = torch.arange(seen, seen + n, device=latent.device)
        pos = position_ids.to(torch.int32).reshape(-1, n).expand(b, n)
        self._positions.append(pos)
        return self._latent.append(latent)

    def for_call(self, position_ids: torch.Tensor | None) -> DARCall:
        return DARCall(self, position_ids)

    def nbytes(self) -> int:
        """Bytes of storage held: the window's buffer and the latent / position buffers at their capacity."""
        return self._near.nbytes() + self._latent.nbytes() + self._positions.nbytes()

    def used_nbytes(self) -> int:
        """Bytes of what is kept: the full K/V of at most ``window`` tokens, every latent and position."""
        return self._near.used_nbytes() + self._latent.used_nbytes() + self._positions.used_nbytes()

    def _per_row(self, pick) -> None:
        """Apply ``pick`` to the batch dimension of every buffer (beam search, batch selection)."""
        self._near.map_rows(pick)
        self._latent.map(pick)
        self._positions.map(pick)
        if self.is_initialized:
            self.keys, self.values = self._near.k, self._near.v

    def reset(self) -> None:
        self._near = RollingKVCache(self.window)
        self._latent.clear()
        self._positions.clear()
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a DAR cache cannot be cropped: the full K/V it dropped cannot come back")


class DARCall:
    """What ``DARAttention`` decodes with for one call on a Hugging Face model (the interface of
    ``DARCache``): the attention module already put this call's K/V into the layer, ``update`` adds the
    latents."""

    def __init__(self, layer: DARCacheLayer, position_ids: torch.Tensor | None) -> None:
        self.layer, self.position_ids = layer, position_ids
        self.absorbed = None  # W_up is never absorbed here: the host's K/V path runs on h' = c W_up

    def update(self, k, v, latent):
        """k, v: what the layer's ``update`` returned (kept + new); returns (k, v, all latents)."""
        return k, v, self.layer.add_latents(latent, self.position_ids)

    def positions(self) -> torch.Tensor:
        return self.layer.positions


# mechanism kind -> its own cache layer on Hugging Face models, made from the mechanism module
# (dar_latent keeps the same: the window's K/V, and per token its latent + rotated key in the latent row)
OWN_LAYERS = {"dar": lambda mech: DARCacheLayer(mech.cfg.window),
              "dar_latent": lambda mech: DARCacheLayer(mech.cfg.window)}


def has_own_layer(module, kind: str) -> bool:
    """Whether mechanism class (or module) ``module`` of ``kind`` decodes with a cache layer of its own."""
    return kind in OWN_LAYERS or hasattr(module, "new_hf_cache_layer")


def new_own_layer(mech):
    """A new cache layer of the mechanism's own (``has_own_layer``), else an ``InPlaceLayer``."""
    make = getattr(mech, "new_hf_cache_layer", None)
    if make is not None:
        return make()
    own = OWN_LAYERS.get(mech.cfg.kind)
    return InPlaceLayer() if own is None else own(mech)


def own_layer(cache: Cache, layer_idx: int, mech, new_tokens: int, key: torch.Tensor, value: torch.Tensor):
    """The mechanism's own layer of ``cache`` at ``layer_idx``, or None when the mechanism decodes with
    every key (then the layer becomes an ``InPlaceLayer``). The attention module has just updated the layer
    with this call's ``new_tokens`` tokens and handed over ``key``, ``value``: a ``DynamicLayer`` that was
    empty before this call (then ``key``, ``value`` are the new tokens') is replaced by the mechanism's
    layer, holding the same tokens; for a mechanism with its own layer, one holding earlier keys is
    refused (a plain mechanism leaves it as it is)."""
    layer = cache.layers[layer_idx]
    if not has_own_layer(mech, mech.cfg.kind):
        if type(layer) is DynamicLayer and layer.get_seq_length() == new_tokens:
            cache.layers[layer_idx] = fresh = InPlaceLayer()
            fresh.update(key, value)
        return None
    if hasattr(layer, "for_call"):
        return layer
    if not isinstance(layer, DynamicLayer) or layer.get_seq_length() != new_tokens:
        raise RuntimeError(f"{type(mech).__name__} decodes with its own compressed cache, not with a "
                           f"{type(cache).__name__} holding every key ({type(layer).__name__}, "
                           f"{layer.get_seq_length() - new_tokens} earlier tokens): start from past_key_values="
                           "None, an empty DynamicCache or allhere.hf.new_cache(model)")
    fresh = new_own_layer(mech)
    fresh.update(key, value)
    cache.layers[layer_idx] = fresh
    return fresh


def new_cache(model, reserve: int | None = None) -> Cache:
    """An empty transformers ``Cache`` for a converted model: each converted layer the mechanism's own
    (``new_own_layer``) or an ``InPlaceLayer``; the layers left unconverted (a hybrid's sliding
    layers) transformers' own. Pass it to ``generate`` or ``forward`` with ``**cache_kwargs(cache)``;
    ``generate`` builds an equivalent one by itself. ``reserve``: the tokens the in-place layers will hold
    (prompt + new tokens), allocated at once: without it a layer filled by a long prompt doubles its
    buffer at the first new token (a 128k-token prompt would hold room for 256k)."""
    mechs = mechanism_layers(model)
    if not mechs:
        raise ValueError("this model has no allhere mechanisms: convert it with allhere.hf.convert first")
    cache = DynamicCache(config=model.config)
    for mech in mechs:
        layer = cache.layers[mech.layer_index] = new_own_layer(mech)
        if reserve is not None and isinstance(layer, InPlaceLayer):
            layer.reserve(reserve)
    return cache


def cache_kwargs(cache: Cache) -> dict:
    """``{name: cache}`` to hand ``generate`` or a forward a cache: ``cache`` where transformers takes that
    name (it renamed ``past_key_values``, which then warns), else ``past_key_values``."""
    from transformers.generation import utils

    return {"cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values": cache}


def cache_nbytes(cache: Cache, used: bool = False) -> int:
    """Bytes held by a transformers cache: the storage of every layer's tensors (the in-place layers'
    capacity, spare room included), or with ``used=True`` the bytes of the tokens they keep."""
    def layer_bytes(layer):
        if hasattr(layer, "nbytes"):
            return layer.used_nbytes() if used else layer.nbytes()
        size = view_bytes if used else storage_bytes
        return size(layer.keys) + size(layer.values)

    return sum(layer_bytes(layer) for layer in cache.layers)
