"""The decoding cache of AA-MoE: the context's keys and values (post-RoPE, as the host gives them), the
summary of every complete chunk (its last token's representation, for the chunk router) and the running
normaliser of the parameter-free "prefix" budget predictor."""

from __future__ import annotations

import torch

from ..softmax import merge_lse
from .caches import KVCache


class AAMoECache:
    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.kv = KVCache()
        self.summaries: torch.Tensor | None = None  # [b, complete chunks, d]
        self.lse: torch.Tensor | None = None  # [b] logsumexp of the budget logits u seen so far
        self.seen = 0  # tokens seen

    k = property(lambda self: self.kv.k)
    v = property(lambda self: self.kv.v)

    def __len__(self) -> int:
        return self.seen

    def nbytes(self) -> int:
        """Bytes of storage held: the K/V buffers at their capacity (``KVCache.nbytes``), summaries, normaliser."""
        return self.kv.nbytes() + sum(t.numel() * t.element_size() for t in (self.summaries, self.lse) if t is not None)

    def used_nbytes(self) -> int:
        """Bytes of what is kept: the tokens' K/V, summaries, normaliser."""
        return self.kv.used_nbytes() + sum(t.numel() * t.element_size() for t in (self.summaries, self.lse)
                                           if t is not None)

    def update(self, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor | None]:
        """Add the new tokens (k, v [b, kv_heads, n, d]; h [b, n, d_model]); return every key, value and
        chunk summary so far (the chunks completed by these tokens included)."""
        k_all, v_all = self.kv.update(k, v)
        pos = self.seen + torch.arange(h.shape[1], device=h.device)
        last = (pos + 1) % self.chunk == 0
        if bool(last.any()):
            new = h[:, last].detach()
            self.summaries = new if self.summaries is None else torch.cat([self.summaries, new], 1)
        self.seen += h.shape[1]
        return k_all, v_all, self.summaries

    def update_normaliser(self, u: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """(logsumexp of the budget logits before u [b, n], tokens before); then include u."""
        before, seen = self.lse, self.seen - u.shape[1]
        lse = torch.logsumexp(u.detach(), -1)
        self.lse = merge_lse(before, lse)
        return before, seen
