"""Sequence boundaries (padding, packed documents) as segment starts: read off a dense mask built by
others (``segment_starts``), built from what a collator knows (``starts_from``), and turned into a
mask (``within_segments``), and the first keys of each segment (``segment_sinks``)."""

from __future__ import annotations

import torch

from .mask import Mask


def segment_starts(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor | None:
    """Read segment starts off a dense mask, for masks built by others (Hugging Face builds one per
    forward; ``allhere.hf`` converts it once, here). If ``mask`` (bool [batch, 1, q_len, kv_len], True =
    may attend), taken together with causality as the attention ops take it, is causal attention within
    contiguous segments -- the sequences of a padded batch, or the documents of packed sequences --
    return, per query, the first key of its segment ([batch, q_len] int64), -1 for a query that does not
    see itself; otherwise None.

    Checked: a query that sees itself sees exactly the keys from its segment's start to itself; a segment
    starts at a query or before the first one; no such query sees the position of a query that does not
    see itself (a padding query, whose output is therefore never read). Queries are the last q_len
    positions. Code that knows its boundaries passes them directly (``starts_from``).
    """
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


def starts_from(padding_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Segment starts [batch, n] of a batch, from what the collator knows: ``padding_mask`` [batch, n]
    (True = a real token; padding may sit on either side) and/or ``position_ids`` [batch, n] that restart
    at 0 where a packed document starts. A real token's segment starts at its document's first token (and
    not before its run of real tokens); a padding token gets -1. None when neither is given."""
    if padding_mask is None and position_ids is None:
        return None
    ref = padding_mask if padding_mask is not None else position_ids
    b, n = ref.shape
    idx = torch.arange(n, device=ref.device).expand(b, n)
    starts = torch.zeros(b, n, dtype=torch.long, device=ref.device)
    if position_ids is not None:
        starts = (idx - position_ids.long()).clamp_min(0)
    if padding_mask is None:
        return starts
    real = padding_mask.bool()
    run_start = torch.where(real & ~torch.cat([real.new_zeros(b, 1), real[:, :-1]], 1), idx, 0).cummax(1).values
    return torch.where(real, torch.maximum(starts, run_start), -1)


def within_segments(starts: torch.Tensor, q_offset: int = 0) -> Mask:
    """Mask of segment starts [batch, q_len] (``starts_from``): query i sees key j iff starts[b, i] <= j, and
    nothing when starts is -1 (no block tests). AND it with a causal pattern."""

    def pred(b, h, q_idx, kv_idx):
        s = starts[b, q_idx - q_offset]
        return (s >= 0) & (kv_idx >= s)

    return Mask(pred, name="within_segments")


def segment_sinks(n_sinks: int, starts: torch.Tensor | None = None, q_offset: int = 0) -> Mask:
    """Attention sinks of each query's own segment: query i sees key j iff s <= j < s + ``n_sinks`` and j <= i,
    s = starts[b, i] (segment starts [batch, q_len] as ``within_segments`` takes them; -1: nothing), or s = 0
    without ``starts`` (the first keys of the sequence, as ``sinks``). OR it with a window (AHA's local
    branch with sinks, ``AHAConfig.sinks``). No block tests."""

    def pred(b, h, q_idx, kv_idx):
        s = 0 if starts is None else starts[b, q_idx - q_offset]
        ok = (kv_idx >= s) & (kv_idx - s < n_sinks) & (kv_idx <= q_idx)
        return ok if starts is None else ok & (s >= 0)

    return Mask(pred, name=f"segment_sinks_{n_sinks}")
