"""Mechanism ``dar``: Distance-Adaptive Representation, from "Dual Dimensionality for Local and Global
Attention" (arXiv:2606.18587): full-dimensional K/V near the query, K/V rebuilt from a d_down bottleneck
far from it, one softmax over all preceding tokens.

For query i and key j <= i: K/V come from h_j when i - j < w and from h'_j = (h_j W_down) W_up otherwise,
through the same W_K / W_V and RoPE (Eqs. 1-4). The attention runs in query blocks
(``ops.dar.dar_attention``); ``ops.dar.dar_attention_reference`` is its dense reference.

Inference cache (``DARCache``), which realises the paper's KV-cache saving: the last ``w`` tokens keep
their full K/V in a rolling buffer; every token keeps only its d_down latent c = h W_down. Distant K/V
are rebuilt from the latents at every step. Where the host's K/V path is plain linear maps (our
decoder), W_up is absorbed into W_K / W_V once per cache (W_K' = W_K W_up, W_V' = W_V W_up: [kv_dim,
d_down]), so a distant key is RoPE(c W_K'^T) and a distant value c W_V'^T; elsewhere (Hugging Face
families with q/k norms) the host's own K/V path runs on h' = c W_up. Trade-off: the cache holds d_down
numbers per token instead of 2 x kv_heads x head_dim, and each step spends about 2 x d_down x kv_dim
multiply-adds per cached token where a plain cache only reads. RoPE rotates keys by their position after
the projection, so rotated distant keys could only be cached by giving the memory saving back.

On Hugging Face models the same cache lives in transformers' Cache API: the host builds the layer
(``allhere.hf.cache.DARCacheLayer``: rolling full K/V the attention module updates itself, the latent and
position of every token), and the distant K/V of cached tokens are rebuilt through the
module's own K/V path at their own positions (``AttentionCall.project_kv(h, positions)``).

Context parallelism (``allhere.distributed.context``, ring attention): a rank's key chunk travels as its
latents (d_down numbers per token instead of the plain ring's 2 x kv_heads x head_dim), plus its full K/V
only to a rank with some query that has the chunk within its window; the reading rank rebuilds the distant
K/V (W_up, then the host's K/V path at the chunk's positions), exactly as on one process, gradients
included (``context_parallel_plan``, ``allhere.distributed.ring_far``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import masks
from ..ops.common import segment_mask
from ..ops.dar import dar_attention
from ..registry import Serving, register
from ..validation import ConfigError, check_int
from .base import AttentionCall, AttentionDims, AttentionMechanism, ContextParallelPlan, FarKV
from .caches import GrowingTensor, KVCache, RollingKVCache, view_bytes


@dataclass(frozen=True)
class DARConfig:
    """Distance-adaptive representation: keys/values of the ``window`` most recent tokens come from the
    full hidden state h, those of older tokens from h' = (h W_down) W_up, one softmax over all.

    window = 0 sends every token through the bottleneck (the "uniform reduction" baseline); d_down = d
    keeps the modules but no bottleneck.
    """

    window: int = 128  # w: tokens j with i - j < w use full-dimensional K/V (the current token included)
    d_down: int = 64  # bottleneck width of W_down (d x d_down) and W_up (d_down x d)

    kind: str = field(default="dar", init=False)

    def __post_init__(self) -> None:
        check_int("DARConfig", "window", self.window, 0)
        check_int("DARConfig", "d_down", self.d_down, 1)

    def check_dims(self, d_model: int) -> None:
        """The bottleneck cannot be wider than the hidden state it compresses."""
        check_int("DARConfig", "d_down", self.d_down, 1)
        if self.d_down > d_model:
            raise ConfigError(f"DARConfig.d_down = {self.d_down} is invalid: expected <= d_model = {d_model}")


def far_keys(window: int) -> masks.Mask:
    """DAR's far-key map as a mask: query i reads key j through the bottleneck when i - j >= window (the
    causal keys outside ``masks.sliding_window(window)``, which are read full-dimensional); with its exact
    block tests: ``tiles`` (some entry of the rectangle is far) and ``dense`` (every entry is). A pure piece a
    host reads a cache of rebuilt keys with (vLLM serving)."""
    check_int("far_keys", "window", window, 0)

    def pred(b, h, q_idx, kv_idx):
        return q_idx - kv_idx >= window

    def tiles(b, h, ql, qh, kl, kh):  # the rectangle's corner (qh, kl)
        return qh - kl >= window

    def dense(b, h, ql, qh, kl, kh):  # its corner (ql, kh)
        return ql - kh >= window

    return masks.Mask(pred, tiles, dense, name=f"dar_far_{window}")


class DARCache:
    """Rolling full K/V of the last ``window`` tokens plus the d_down latent of every token, both written in
    place (``allhere.mechanisms.caches``: a rolling buffer, and a latent buffer that doubles when full);
    ``update`` returns views valid until the next update."""

    def __init__(self, window: int) -> None:
        self.near = RollingKVCache(window) if window else None  # window 0: no full K/V is kept
        self._latent = GrowingTensor(1)  # [b, tokens, d_down]
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None  # (W_K W_up, W_V W_up), set once

    k = property(lambda self: None if self.near is None else self.near.k)
    v = property(lambda self: None if self.near is None else self.near.v)
    latent = property(lambda self: self._latent.view())  # [b, tokens, d_down]

    def __len__(self) -> int:
        return self._latent.length

    def nbytes(self) -> int:
        """Bytes of storage held: the near buffer and latent buffer at their capacity, and the absorbed
        weights (a per-layer constant)."""
        near = 0 if self.near is None else self.near.nbytes()
        return near + self._latent.nbytes() + sum(view_bytes(t) for t in self.absorbed or ())

    def used_nbytes(self) -> int:
        """Bytes of what is kept: the near K/V of at most ``window`` tokens, every latent, the absorbed weights."""
        near = 0 if self.near is None else self.near.used_nbytes()
        return near + self._latent.used_nbytes() + sum(view_bytes(t) for t in self.absorbed or ())

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` latents in all: no reallocation until then."""
        self._latent.reserve(tokens)

    def update(self, k, v, latent):
        """Add the new tokens; return (near k, near v, all latents). Near k/v cover the last positions."""
        latents = self._latent.append(latent)
        k_near, v_near = (k, v) if self.near is None else self.near.update(k, v)
        return k_near, v_near, latents

    def positions(self) -> torch.Tensor:
        """[tokens] the position of every cached latent, as the host's ``project_kv`` takes them."""
        return torch.arange(len(self), device=self._latent.data.device)


def cache_bytes(tokens: int, d_model: int, heads: int, kv_heads: int, d_down: int, window: int, dtype,
                chunk: int = 4096) -> tuple[int, int]:
    """(DAR cache bytes, plain KV cache bytes) of one layer, batch 1, after ``tokens`` tokens: both caches
    filled through their own ``update`` with tensors of the real shapes (no attention computed); the DAR
    cache also holds the absorbed weights W_K W_up and W_V W_up (a constant per layer, counted). The bytes
    of what each cache keeps (``used_nbytes``): their buffers' spare room (both grow by doubling; the
    rolling window has a quarter of ``window`` to spare) is an implementation choice, not counted."""
    hd = d_model // heads
    dar, vanilla = DARCache(window), KVCache()
    dar.absorbed = tuple(torch.zeros(kv_heads * hd, d_down, dtype=dtype) for _ in range(2))
    for done in range(0, tokens, chunk):
        k = torch.zeros(1, kv_heads, min(chunk, tokens - done), hd, dtype=dtype)
        dar.update(k, k.clone(), torch.zeros(1, k.shape[2], d_down, dtype=dtype))
        vanilla.update(k, k.clone())
    return dar.used_nbytes(), vanilla.used_nbytes()


# served (allhere.serve, vLLM's CPU backend, vLLM's own model classes only: it rebuilds distant keys through
# the block's qkv_proj at each key's position): the window's K/V and every token's latent in caches of their own
@register(DARConfig, summary="full K/V near the query, a d_down bottleneck far from it",
          serving=Serving("dar", own_cache_group="it keeps the window's K/V and every token's latent in caches of "
                          "their own", transformers_backend=False))
class DARAttention(AttentionMechanism):
    """Needs the host's K/V path (``call.project_kv``) for the distant keys and values. Decodes with a
    ``cache`` offering ``DARCache``'s interface (``update(k, v, latent)``, ``positions()``, ``absorbed``):
    a ``DARCache``, or on Hugging Face models a call's view of ``allhere.hf.cache.DARCacheLayer``."""

    hf_cache = False  # not transformers' every-key cache: one of its own, built by the host (``allhere.hf.cache``)

    def __init__(self, cfg: DARConfig, dims: AttentionDims) -> None:
        super().__init__(cfg, dims)
        cfg.check_dims(dims.d_model)
        self.down = nn.Linear(dims.d_model, cfg.d_down, bias=False)
        self.up = nn.Linear(cfg.d_down, dims.d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W_down with orthonormal rows, W_up its transpose: h' is h projected onto a d_down-dim subspace
        (exactly h when d_down = d), so a converted model starts close to the original."""
        with torch.no_grad():
            nn.init.orthogonal_(self.down.weight)
            self.up.weight.copy_(self.down.weight.T)

    def new_cache(self) -> DARCache:
        return DARCache(self.cfg.window)

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        if call.project_kv is None:
            raise ValueError("DAR needs the host's K/V projection (AttentionCall.project_kv)")
        latent = self.down(call.x)
        if cache is None and k.shape[2] != q.shape[2]:
            raise RuntimeError("DAR decodes only with its own compressed cache (DARCache; on Hugging Face models "
                               "the layers of allhere.hf.new_cache), not with every key cached by the host")
        if cache is None:
            k_far, v_far = call.project_kv(self.up(latent))
            return dar_attention(q, k, v, k_far, v_far, self.cfg.window, call.scale, self._mask(call, q, k)), None
        k_near, v_near, latents = cache.update(k, v, latent)
        positions = cache.positions()
        if call.kv_weights is not None:  # plain linear K/V: absorb W_up once, project the latents directly
            if cache.absorbed is None:
                cache.absorbed = tuple(w @ self.up.weight for w in call.kv_weights)
            k_far, v_far = call.project_kv(latents, positions, weights=cache.absorbed)
        else:
            k_far, v_far = call.project_kv(self.up(latents), positions)
        pad = k_far.shape[2] - k_near.shape[2]  # positions whose full K/V are gone: never near for these queries
        k_near, v_near = (torch.nn.functional.pad(t, (0, 0, pad, 0)) for t in (k_near, v_near))
        return dar_attention(q, k_near, v_near, k_far, v_far, self.cfg.window, call.scale,
                             self._mask(call, q, k_far)), None

    def context_parallel_plan(self, call: AttentionCall, n: int) -> ContextParallelPlan:
        """Under the ring, a chunk travels as its latents c = h W_down (``FarKV.payload``); the reading rank
        rebuilds its distant K/V (``expand``: W_up, then the host's K/V path at the chunk's own positions),
        and the chunk's full K/V travel only to a rank with some query that has the chunk within its window."""
        if call.project_kv is None:
            raise ValueError("DAR needs the host's K/V projection (AttentionCall.project_kv)")
        up, project_kv = self.up, call.project_kv
        near = masks.sliding_window(self.cfg.window) if self.cfg.window else None
        return ContextParallelPlan(reads=masks.causal, far=FarKV(
            payload=self.down(call.x), expand=lambda c, positions: project_kv(up(c), positions), near=near))

    @staticmethod
    def _mask(call: AttentionCall, q, k):
        if call.segment_starts is None:
            return None
        return segment_mask(call.segment_starts, q.shape[2], k.shape[2])
