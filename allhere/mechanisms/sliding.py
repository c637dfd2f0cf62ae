"""Sliding-window attention and its rolling KV cache (memory bounded by the window, seeds/004)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import SlidingConfig
from ..ops.sliding import sliding_window_attention


class RollingKVCache:
    """Keeps only the ``window`` most recent keys and values: what any later query may still read."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the kept keys followed by the new ones (contiguous positions), then keep the last ``window``."""
        k_all = k if self.k is None else torch.cat([self.k, k], dim=2)
        v_all = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.k, self.v = k_all[:, :, -self.window:], v_all[:, :, -self.window:]
        return k_all, v_all


class SlidingAttention(nn.Module):
    """Mechanism ``sliding``: each query sees its ``window`` most recent keys, itself included."""

    def __init__(self, cfg: SlidingConfig, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.cfg = cfg

    def new_cache(self) -> RollingKVCache:
        return RollingKVCache(self.cfg.window)

    def forward(self, q, k, v, x, cache=None, router_logits=None):
        if cache is not None:
            k, v = cache.update(k, v)
        return sliding_window_attention(q, k, v, self.cfg.window), None
