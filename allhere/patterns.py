"""Helpers of the sparse attention patterns (``allhere.masks``): the global-token flags of
``global_tokens`` / ``longformer``, and the dense reference of any pattern.

Global tokens (Longformer, arXiv:2004.05150) are given by position: the first ``g`` tokens, a list of
positions, or the positions holding given token ids (a separator, a question mark). The last needs the
input ids, which an attention mechanism never sees (the host hands it q, k, v and the block input x);
``global_from_ids`` is therefore for code that has the ids (masks, plots, an encoder of one's own), while
the ``longformer`` mechanism takes first-g and positions only.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .masks import MaskFn, dense_mask
from .ops.full import masked_attention


def global_first(n: int, g: int) -> torch.Tensor:
    """bool [n]: the first ``g`` positions are global."""
    return torch.arange(n) < g


def global_at(n: int, positions: Iterable[int]) -> torch.Tensor:
    """bool [n]: the given positions (those below n) are global."""
    out = torch.zeros(n, dtype=torch.bool)
    pos = [p for p in positions if 0 <= p < n]
    if pos:
        out[torch.tensor(pos)] = True
    return out


def global_from_ids(ids: torch.Tensor, token_ids: Iterable[int]) -> torch.Tensor:
    """bool like ``ids`` ([n] or [batch, n]): positions holding one of ``token_ids`` are global."""
    return torch.isin(ids, torch.tensor(list(token_ids), dtype=ids.dtype, device=ids.device))


def reference_attention(q, k, v, pred: MaskFn, scale=None, key_offset: int = 0) -> torch.Tensor:
    """The dense reference of a pattern: ``masked_attention`` under ``dense_mask(pred)`` (queries: the last
    q_len of the keys at ``key_offset`` ..)."""
    b, h, lq = q.shape[:3]
    mask = dense_mask(pred, lq, k.shape[2], q.device, batch=b, heads=h, key_offset=key_offset)
    return masked_attention(q, k, v, mask, scale)
