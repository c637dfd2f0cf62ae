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


class PatternKVCache(KVCache):
    """Keeps the keys a sparse causal pattern may still read: the last ``span`` positions, the positions
    ``fixed(positions)`` marks (attention sinks, global tokens), and every key while a query that reads
    the whole past may still come (``keep_all_until``: the last such query's position, -1 = none).

    The kept keys are not contiguous positions: ``update_at`` returns their absolute positions too
    (``positions``), and ``update`` the keys alone. Memory: ``span`` + the fixed positions seen, once the
    last whole-past query has passed.
    """

    def __init__(self, span: int, fixed=None, keep_all_until: int = -1) -> None:
        super().__init__()
        self.span = span
        self.fixed = fixed
        self.keep_all_until = keep_all_until
        self.seen = 0  # tokens added so far: the next token's absolute position
        self.positions: torch.Tensor | None = None  # int64 [tokens] absolute positions of the kept keys

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self.positions is None else self.positions.untyped_storage().nbytes())

    def update_at(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add the new tokens; return the kept keys and values followed by the new ones, and their
        absolute positions (increasing); then keep what later queries may read."""
        n = k.shape[2]
        new = torch.arange(self.seen, self.seen + n, device=k.device)
        k_all = k if self.k is None else torch.cat([self.k, k], dim=2)
        v_all = v if self.v is None else torch.cat([self.v, v], dim=2)
        pos = new if self.positions is None else torch.cat([self.positions, new])
        self.seen += n
        if self.seen > self.keep_all_until + 1:
            keep = pos >= self.seen - self.span
            if self.fixed is not None:
                keep |= self.fixed(pos)
        else:
            keep = torch.ones_like(pos, dtype=torch.bool)
        if bool(keep.all()):
            self.k, self.v, self.positions = k_all, v_all, pos
        else:  # copies: a view would keep the longer tensors alive
            idx = keep.nonzero().flatten()
            self.k, self.v = k_all.index_select(2, idx), v_all.index_select(2, idx)
            self.positions = pos[idx]
        return k_all, v_all, pos

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_all, v_all, _ = self.update_at(k, v)
        return k_all, v_all
