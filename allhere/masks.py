"""Attention masks as predicates ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend).

The same predicate feeds the dense references (``dense_mask``), FlexAttention and any plot of the
pattern. Indices are absolute token positions. Predicates work on broadcastable integer tensors, so
they are written with tensor operators (``&``, ``|``), never ``and``/``or``.

The one window definition of the project: window ``w`` = the ``w`` most recent keys including the
current token, i.e. ``0 <= q_idx - kv_idx < w`` (seeds/003 Eq. 4; Hugging Face ``sliding_window=w``;
flash-attn ``window_size=(w - 1, 0)``).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window(window: int) -> MaskFn:
    """Causal window of ``window`` keys, the current one included."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    def pred(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    pred.__name__ = f"sliding_window_{window}"
    return pred


def and_masks(*preds: MaskFn) -> MaskFn:
    def pred(b, h, q_idx, kv_idx):
        out = preds[0](b, h, q_idx, kv_idx)
        for p in preds[1:]:
            out = out & p(b, h, q_idx, kv_idx)
        return out

    return pred


def or_masks(*preds: MaskFn) -> MaskFn:
    def pred(b, h, q_idx, kv_idx):
        out = preds[0](b, h, q_idx, kv_idx)
        for p in preds[1:]:
            out = out | p(b, h, q_idx, kv_idx)
        return out

    return pred


def dense_mask(pred: MaskFn, q_len: int, kv_len: int, device=None, q_offset: int | None = None,
               batch: int = 1, heads: int = 1) -> torch.Tensor:
    """Evaluate ``pred`` on a grid: bool tensor [batch, heads, q_len, kv_len].

    Queries are the last ``q_len`` positions of the ``kv_len`` keys (bottom-right alignment, as in a KV
    cache) unless ``q_offset`` says where the first query sits.
    """
    off = kv_len - q_len if q_offset is None else q_offset
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1) + off
    k = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    return pred(b, h, q, k).expand(batch, heads, q_len, kv_len)


_last_segments: tuple = (None, -1, None, None)  # (weak reference to the mask, its version, sizes, result)


def segment_starts(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor | None:
    """If ``mask`` (bool [batch, 1, q_len, kv_len], True = may attend), taken together with causality as
    the attention ops take it, is causal attention within contiguous segments -- the sequences of a
    padded batch, or the documents of packed sequences, as transformers builds them -- return, per
    query, the first key of its segment ([batch, q_len] int64), -1 for a query that does not see itself;
    otherwise None.

    Checked: a query that sees itself sees exactly the keys from its segment's start to itself; a segment
    starts at a query or before the first one; no such query sees the position of a query that does not
    see itself (a padding query, whose output is therefore never read). Queries are the last q_len
    positions.

    Every layer of a model gets the same mask tensor, so the last answer is kept for that very tensor (a
    weak reference: a new tensor, or one changed in place, is read afresh; an inference-mode tensor has
    no version counter and is always read afresh).
    """
    global _last_segments
    if mask.is_inference():
        return _segment_starts(mask, q_len, kv_len)
    ref, version, sizes, result = _last_segments
    if ref is not None and ref() is mask and version == mask._version and sizes == (q_len, kv_len):
        return result
    result = _segment_starts(mask, q_len, kv_len)
    _last_segments = (weakref.ref(mask), mask._version, (q_len, kv_len), result)
    return result


def _segment_starts(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor | None:
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (q_len, kv_len):
        return None
    # Memory: one [b, q_len, kv_len] temporary besides the mask.
    j = torch.arange(kv_len, device=mask.device)
    pos = torch.arange(q_len, device=mask.device) + (kv_len - q_len)
    m = mask[:, 0] & (j <= pos[:, None])  # what the ops use: the mask and causality
    real = m[:, torch.arange(q_len, device=mask.device), pos]  # [b, q_len]: sees itself
    first = m.view(torch.uint8).argmax(-1)  # the first key each query sees (argmax: the first maximum)
    exact = (m.sum(-1) == pos - first + 1) | ~real  # every key from the first to itself, and no other
    del m
    same_or_new = (first[:, 1:] == pos[1:]) | (real[:, :-1] & (first[:, 1:] == first[:, :-1])) | ~real[:, 1:]
    # Positions some real query reads: each covers [first, itself]; summed as +1 / -1 steps.
    steps = torch.zeros(mask.shape[0], kv_len + 1, device=mask.device, dtype=torch.int64)
    steps.scatter_add_(1, first, real.long()).scatter_add_(1, pos.expand_as(first) + 1, -real.long())
    seen = (steps.cumsum(1)[:, kv_len - q_len:kv_len] > 0)  # [b, q_len]
    if not bool(exact.all()) or not bool(same_or_new.all()) or bool((seen & ~real).any()):
        return None
    return torch.where(real, first, -1)
