"""Full causal attention and the growing KV cache it (and AHA) decodes with."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FullConfig
from ..ops.full import causal_attention


class KVCache:
    """Keeps every key and value seen so far: [batch, kv_heads, tokens, dim]."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' k, v and return all keys and values to attend to."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class FullAttention(nn.Module):
    """Mechanism ``full``: every query attends to the whole prefix."""

    def __init__(self, cfg: FullConfig, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.cfg = cfg

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(self, q, k, v, x, cache=None, router_logits=None):
        """q [b, h, n, d], k/v [b, kv_heads, n, d] of the new tokens; returns (out [b, h, n, d], None)."""
        if cache is not None:
            k, v = cache.update(k, v)
        return causal_attention(q, k, v), None
