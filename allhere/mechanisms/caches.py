"""The KV caches most mechanisms decode with: every key (full attention, AHA) or the last ``window``."""

from __future__ import annotations

import torch


class KVCache:
    """Keeps every key and value seen so far: [batch, kv_heads, tokens, dim]."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def nbytes(self) -> int:
        """Bytes of the storage the cache keeps alive."""
        return sum(t.untyped_storage().nbytes() for t in (self.k, self.v) if t is not None)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' k, v and return all keys and values to attend to."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class RollingKVCache(KVCache):
    """Keeps only the ``window`` most recent keys and values: what any later query may still read."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.dropped = 0  # positions no longer kept: the absolute position of the first kept key

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the kept keys followed by the new ones (contiguous positions), then keep the last ``window``."""
        k_all = k if self.k is None else torch.cat([self.k, k], dim=2)
        v_all = v if self.v is None else torch.cat([self.v, v], dim=2)
        over = k_all.shape[2] - self.window
        self.dropped += max(0, over)
        # A slice would keep the whole longer tensor (e.g. a prefill's) alive: keep a copy of the window.
        self.k, self.v = (t[:, :, -self.window:].clone() if over > 0 else t for t in (k_all, v_all))
        return k_all, v_all
