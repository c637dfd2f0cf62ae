"""Distance-adaptive representation (seeds/001): full-dimensional K/V near the query, K/V rebuilt from a
d_down bottleneck far from it, one softmax over all preceding tokens.

For query i and key j <= i: K/V come from h_j when i - j < w and from h'_j = (h_j W_down) W_up otherwise,
through the same W_K / W_V and RoPE (Eqs. 1-4). The attention runs in query blocks
(``ops.dar.dar_attention``); ``ops.dar.dar_attention_naive`` is its dense reference.

Inference cache (``DARCache``), which realises the memory saving sketched in seeds/001 section 5: the last
``w`` tokens keep their full K/V in a rolling buffer; every token keeps only its d_down latent c = h W_down.
W_up is absorbed into W_K / W_V once per cache (W_K' = W_K W_up, W_V' = W_V W_up: [kv_dim, d_down]), so a
distant key is RoPE(c W_K'^T) and a distant value c W_V'^T. They are rebuilt from the latents on demand at
every step. Trade-off: the cache holds d_down numbers per token instead of 2 x kv_heads x head_dim, and
each step spends 2 x d_down x kv_dim multiply-adds per cached token where a plain cache only reads. RoPE
rotates keys by their position after the projection, so rotated distant keys could only be cached by
giving the memory saving back; values (no RoPE) could be cached at kv_dim per token, which would also
give it back.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import DARConfig
from ..ops.dar import dar_attention
from .sliding import RollingKVCache


class DARCache:
    """Rolling full K/V of the last ``window`` tokens plus the d_down latent of every token."""

    def __init__(self, window: int) -> None:
        self.near = RollingKVCache(window) if window else None  # window 0: no full K/V is kept
        self.latent: torch.Tensor | None = None  # [b, tokens, d_down]
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None  # (W_K W_up, W_V W_up), set once

    k = property(lambda self: None if self.near is None else self.near.k)
    v = property(lambda self: None if self.near is None else self.near.v)

    def __len__(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def nbytes(self) -> int:
        """Bytes held: near K/V, latents and the absorbed weights (a per-layer constant)."""
        held = (self.k, self.v, self.latent, *(self.absorbed or ()))
        return sum(t.numel() * t.element_size() for t in held if t is not None)

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

    def forward(self, q, k, v, x, cache=None, router_logits=None, kv_of=None, kv_weights=None, mask=None,
                scale=None):
        """kv_of(h, positions=None, weights=None) -> (k, v) projects inputs like the model's own K/V (RoPE
        at ``positions``, by default the new tokens'; through ``weights`` instead of W_K / W_V if given);
        kv_weights = (W_K, W_V), needed with a cache to absorb W_up. mask: optional bool [b, 1, q, k]
        (padding); scale: softmax scale (default 1 / sqrt(head_dim))."""
        latent = self.down(x)
        if cache is None:
            k_far, v_far = kv_of(self.up(latent))
            return dar_attention(q, k, v, k_far, v_far, self.cfg.window, scale, mask), None
        if cache.absorbed is None:
            cache.absorbed = tuple(w @ self.up.weight for w in kv_weights)
        k_near, v_near, latents = cache.update(k, v, latent)
        total = latents.shape[1]
        k_far, v_far = kv_of(latents, torch.arange(total, device=x.device), weights=cache.absorbed)
        pad = total - k_near.shape[2]  # positions whose full K/V are gone: never near for these queries
        k_near, v_near = (torch.nn.functional.pad(t, (0, 0, pad, 0)) for t in (k_near, v_near))
        return dar_attention(q, k_near, v_near, k_far, v_far, self.cfg.window, scale, mask), None
