"""Distance-adaptive representation (seeds/001): full-dimensional K/V near the query, K/V rebuilt from a
d_down bottleneck far from it, one softmax over all preceding tokens.

For query i and key j <= i: K/V come from h_j when i - j < w and from h'_j = (h_j W_down) W_up otherwise,
through the same W_K / W_V and RoPE (Eqs. 1-4).

Inference cache (``DARCache``), which realises the memory saving sketched in seeds/001 section 5: the last
``w`` tokens keep their full K/V in a rolling buffer; every token keeps only its d_down latent h W_down.
Distant keys and values are rebuilt from the latents on demand (through W_up, W_K, W_V and RoPE at their
positions). Trade-off: the cache holds d_down numbers per token instead of 2 x kv_heads x head_dim, and
each step recomputes the distant K/V from the latents (a d_down x d_kv product per cached token, where a
plain cache only reads). W_up could be folded into W_K / W_V (W_K W_up) to shorten that product; RoPE is
applied after the projection, per position, so the rebuilt keys cannot be cached in rotated form without
giving the saving back.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import DARConfig
from ..ops.dar import dar_attention_naive
from .sliding import RollingKVCache


class DARCache:
    """Rolling full K/V of the last ``window`` tokens plus the d_down latent of every token."""

    def __init__(self, window: int) -> None:
        self.near = RollingKVCache(window) if window else None  # window 0: no full K/V is kept
        self.latent: torch.Tensor | None = None  # [b, tokens, d_down]

    k = property(lambda self: None if self.near is None else self.near.k)
    v = property(lambda self: None if self.near is None else self.near.v)

    def __len__(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.latent) if t is not None)

    def update(self, k, v, latent):
        """Add the new tokens; return (near k, near v, all latents). Near k/v cover the last positions."""
        self.latent = latent if self.latent is None else torch.cat([self.latent, latent], dim=1)
        k_near, v_near = (k, v) if self.near is None else self.near.update(k, v)
        return k_near, v_near, self.latent


class DARAttention(nn.Module):
    """Mechanism ``dar``. Needs the attention module's own K/V projection (``kv_of``)."""

    wants_kv_projection = True

    def __init__(self, cfg: DARConfig, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.down = nn.Linear(d_model, cfg.d_down, bias=False)
        self.up = nn.Linear(cfg.d_down, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W_down with orthonormal rows, W_up its transpose: h' is h projected onto a d_down-dim subspace
        (exactly h when d_down = d), so a converted model starts close to the original."""
        with torch.no_grad():
            nn.init.orthogonal_(self.down.weight)
            self.up.weight.copy_(self.down.weight.T)

    def new_cache(self) -> DARCache:
        return DARCache(self.cfg.window)

    def forward(self, q, k, v, x, cache=None, router_logits=None, kv_of=None):
        """kv_of(h, positions=None) -> (k, v) projects hidden states like the model's own K/V (RoPE at
        ``positions``, by default the new tokens')."""
        latent = self.down(x)
        if cache is None:
            k_far, v_far = kv_of(self.up(latent))
            return dar_attention_naive(q, k, v, k_far, v_far, self.cfg.window), None
        k_near, v_near, latents = cache.update(k, v, latent)
        total = latents.shape[1]
        k_far, v_far = kv_of(self.up(latents), torch.arange(total, device=x.device))
        pad = total - k_near.shape[2]  # positions whose full K/V are gone: never near for these queries
        k_near, v_near = (torch.nn.functional.pad(t, (0, 0, pad, 0)) for t in (k_near, v_near))
        return dar_attention_naive(q, k_near, v_near, k_far, v_far, self.cfg.window), None
