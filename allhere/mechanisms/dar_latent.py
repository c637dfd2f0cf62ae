"""Mechanism ``dar_latent``: DAR ("Dual Dimensionality for Local and Global Attention", arXiv:2606.18587) whose
distant keys are scored in the latent, with decoupled RoPE as in DeepSeek-V2's multi-head latent attention
("DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model", arXiv:2405.04434) and
partial RoPE as in MHA2MLA (arXiv:2502.14837).

For query i and key j <= i: within the window (i - j < w) the host's exact K/V; beyond it, KV head g's key is
[k^R_j ; c_j W_UK_g^T] and its value c_j W_UV_g^T, with c_j = h_j W_down (d_c numbers shared by every head) and
k^R_j the host's own rotated key at the ``rope_pairs`` rotary pairs kept per KV head. The query reads it with
[q^R_i ; q^C_i]: its own rotated channels at those pairs, and its other channels unrotated (the host's rotary
embedding inverted at the query's position, ``AttentionCall.rope``). So
s_ij = (q^R_i . k^R_j + (q^C_i W_UK_g) . c_j) * scale: multi-query attention over [c_j ; k^R_j], one softmax
with the window. The paper's DAR rotates c_j W_up W_K after the up-projection, so every decode step rebuilds
every distant key; here nothing is rebuilt while decoding (``ops.dar_latent``: the absorbed path).

Cache per token and layer: d_c + kv_heads x 2 x rope_pairs numbers, plus the full K/V of the last w tokens
(``DARCache``'s buffers, its latent row holding [c ; k^R]). Plain attention keeps 2 x kv_heads x head_dim.

Weights: ``down`` (W_down), ``up_k`` (W_UK, the content channels of every KV head) and ``up_v`` (W_UV), and the
buffer ``channels`` (which channels are kept rotated). ``reset_parameters`` draws them for training from scratch;
``allhere.mechanisms.dar_latent_init.init_from_host`` sets them from a pretrained host (2-norm pair selection on
calibration text, truncated SVD), which reproduces the host exactly at full rank.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops.common import segment_mask
from ..ops.dar_latent import dar_latent_attention
from ..ops.dar_latent.check import pack_rows
from ..registry import Serving, register
from ..validation import ConfigError, check_int
from .base import AttentionCall, AttentionDims, AttentionMechanism
from .dar import DARCache
from .dar_latent_channels import channel_order, far_queries, in_channel_order, pair_norms, uniform_pairs


@dataclass(frozen=True)
class DARLatentConfig:
    """DAR with distant keys scored in the latent: the ``window`` most recent keys are the host's, older ones a
    d_down latent per token (shared by the heads) plus ``rope_pairs`` rotary pairs per KV head of the host's own
    rotated key. Cache per token beyond the window: d_down + 2 x rope_pairs x kv_heads numbers; it saves memory
    over plain attention's 2 x kv_heads x head_dim while that sum stays below it (aim: half of it or less)."""

    window: int = 128  # w: tokens j with i - j < w are read through the host's full K/V (the current token included)
    d_down: int = 64  # d_c: latent width (W_down: d x d_c), shared by all heads
    rope_pairs: int = 4  # r: rotary frequency pairs per KV head kept rotated for distant keys (MHA2MLA: head_dim / 16)

    kind: str = field(default="dar_latent", init=False)

    def __post_init__(self) -> None:
        check_int("DARLatentConfig", "window", self.window, 0)
        check_int("DARLatentConfig", "d_down", self.d_down, 1)
        check_int("DARLatentConfig", "rope_pairs", self.rope_pairs, 0)

    def check_dims(self, d_model: int, head_dim: int | None = None) -> None:
        """The latent cannot be wider than the hidden state, nor more pairs kept than a head has."""
        if self.d_down > d_model:
            raise ConfigError(f"DARLatentConfig.d_down = {self.d_down} is invalid: expected <= d_model = {d_model}")
        if head_dim is not None and 2 * self.rope_pairs > head_dim:
            raise ConfigError(f"DARLatentConfig.rope_pairs = {self.rope_pairs} is invalid: expected <= head_dim / 2 = "
                              f"{head_dim // 2} (a pair is two channels)")

    def cache_numbers(self, dims: AttentionDims) -> tuple[int, int]:
        """(numbers this variant keeps per distant token and layer, plain attention's 2 x kv_heads x head_dim)."""
        return self.d_down + 2 * self.rope_pairs * dims.kv_heads, 2 * dims.kv_heads * dims.head_dim


# served (allhere.serve, vLLM's CPU backend, vLLM's own model classes: it reads the block's input and inverts
# its rotary embedding): the window's K/V and every token's row [c ; k^R] in caches of their own
@register(DARLatentConfig, summary="DAR whose distant keys are scored in the latent (decoupled RoPE): no key "
                                   "rebuilt while decoding",
          serving=Serving("dar_latent", own_cache_group="it keeps the window's K/V and every token's latent row in "
                          "caches of their own", transformers_backend=False))
class DARLatentAttention(AttentionMechanism):
    """Needs the host's rotary embedding of the queries (``call.rope``: rotate-half hosts). Decodes with a cache
    offering ``DARCache``'s ``update(k, v, latent)``: a ``DARCache``, or on Hugging Face models a call's view of
    ``allhere.hf.cache.DARCacheLayer``; its latent rows hold [c ; k^R of every KV head]."""

    hf_cache = False  # its own cache (the window's K/V, a latent + rotated key per token), built by the host

    def __init__(self, cfg: DARLatentConfig, dims: AttentionDims) -> None:
        super().__init__(cfg, dims)
        cfg.check_dims(dims.d_model, dims.head_dim)
        g, d, r2 = dims.kv_heads, dims.head_dim, 2 * cfg.rope_pairs
        self.down = nn.Linear(dims.d_model, cfg.d_down, bias=False)
        with warnings.catch_warnings():  # every pair kept: no content channel (a zero-element W_UK)
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            self.up_k = nn.Linear(cfg.d_down, g * (d - r2), bias=False)
        self.up_v = nn.Linear(cfg.d_down, g * d, bias=False)
        # per KV head: the kept rotated channels, then the content ones (MHA2MLA's uniform choice until calibrated)
        self.register_buffer("channels", channel_order(uniform_pairs(g, d // 2, cfg.rope_pairs), d, d))
        self.calibration: dict | None = None  # set by ``dar_latent_init.calibrate``: pair norms are summed into it
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """For training from scratch: W_down with orthonormal rows, W_UK and W_UV drawn as the host's
        projections are (std 0.02). A pretrained host is better served by ``dar_latent_init.init_from_host``."""
        with torch.no_grad():
            nn.init.orthogonal_(self.down.weight)
            nn.init.normal_(self.up_k.weight, std=0.02)
            nn.init.normal_(self.up_v.weight, std=0.02)

    @classmethod
    def init_from_host(cls, model: nn.Module, run=None) -> None:
        """MHA2MLA's initialisation from the host (``dar_latent_init.init_from_host``): the 2-norm pair choice
        when ``run`` gives calibration forwards, else the same score on the weights; then the truncated SVD."""
        from .dar_latent_init import init_from_host

        init_from_host(model, run)

    @classmethod
    def host_init_refusal(cls, host: nn.Module) -> str | None:
        from .dar_latent_init import host_refusal

        return host_refusal(host)

    def new_cache(self) -> DARCache:
        return DARCache(self.cfg.window)

    def context_parallel_refusal(self) -> str:
        return ("its distant keys are read with the queries' unrotated part, which the ring's far-key plan (a key "
                "per KV head for every query) does not carry")

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        if call.rope is None:
            raise ValueError("dar_latent needs the host's rotary embedding of the queries (AttentionCall.rope): "
                             "rotate-half hosts only")
        n, r2 = q.shape[2], 2 * self.cfg.rope_pairs
        if cache is None and k.shape[2] != n:
            raise RuntimeError("dar_latent decodes only with its own cache (DARCache; on Hugging Face models the "
                               "layers of allhere.hf.new_cache), not with every key cached by the host")
        if self.calibration is not None:
            return self._calibrating(q, k, v, call, cache), None
        g, d_c = k.shape[1], self.cfg.d_down
        k_rope = in_channel_order(k[:, :, -n:], self.channels)[..., :r2]  # the new tokens' keys at the kept pairs
        rows = pack_rows(self.down(call.x), k_rope)  # [b, n, d_c + g x r2]: c = h W_down, then k^R
        if cache is None:
            k_near, v_near = k, v
        else:  # the window's K/V, and every cached row (this call's included)
            k_near, v_near, rows = cache.update(k, v, rows)
        q_far = far_queries(q, *call.rope, self.channels, r2)
        d = q.shape[-1]
        w_uk = self.up_k.weight.view(g, d - r2, d_c)
        w_uv = self.up_v.weight.view(g, d, d_c)
        mask = None if call.segment_starts is None else segment_mask(call.segment_starts, n, rows.shape[1])
        out = dar_latent_attention(q, q_far, k_near, v_near, rows.to(q.dtype), w_uk, w_uv, self.cfg.window,
                                   call.scale, mask)
        return out, None

    def _calibrating(self, q, k, v, call, cache):
        """The host's own causal attention (every key near), summing each rotary pair's norms of q and k."""
        if k.shape[2] != q.shape[2]:
            raise RuntimeError("calibrate dar_latent layers with forwards that start from an empty cache (or none)")
        rot, stats = call.rope[0].shape[-1], self.calibration
        for name, x in (("q", q), ("k", k)):
            stats[name] = stats.get(name, 0) + pair_norms(x.detach(), rot)
        stats["tokens"] = stats.get("tokens", 0) + q.shape[0] * q.shape[2]
        stats["rot"] = rot
        mask = None if call.segment_starts is None else segment_mask(call.segment_starts, q.shape[2], k.shape[2])
        d_c, g, d = self.cfg.d_down, k.shape[1], q.shape[-1]
        rows = q.new_zeros(q.shape[0], k.shape[2], d_c)  # no rotated pair: every key is near anyway
        return dar_latent_attention(q, q, k, v, rows, q.new_zeros(g, d, d_c), q.new_zeros(g, d, d_c), k.shape[2] + 1,
                                    call.scale, mask)
