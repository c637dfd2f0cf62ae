"""Attention computed by allhere over a paged KV cache, for the served mechanisms that no single vLLM
attention computes: a mask predicate (attention sinks, dilated windows, Longformer, BigBird) and DAR (near
keys full-dimensional, distant ones rebuilt from a bottleneck, under one softmax). Plain torch, no vLLM
import: ``allhere.serve.vllm_paged`` hands it vLLM's cache tensors, slot mapping and block table.

Layout. vLLM allocates the cache tensor of a layer, hands out its blocks to requests (block table), and
keeps them across steps and requests (prefix caching); what a block holds is up to the attention that
writes and reads it. allhere writes and reads its own layout, the same on every device:
``[blocks, block_size, 2 (key, value), kv_heads, head_dim]`` over the tensor's storage; token slot ``s``
(vLLM's slot mapping) is row ``s % block_size`` of block ``s // block_size``.

Reference, not kernel: each request's keys are gathered from its blocks and its queries attend to all of
them densely in float32, one request after another -- exact, and as slow as that sounds for long contexts.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# which of the gathered key sets each (head, query, key) reads: 0, 1, ... or -1 (not at all). Arguments:
# query positions [q, 1], key positions [1, k] (int64), the number of query heads.
Choose = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def paged_view(cache: torch.Tensor, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``cache`` (a layer's whole cache tensor, any shape, contiguous) as [blocks, block_size, 2, kv_heads,
    head_dim]."""
    per_block = block_size * 2 * kv_heads * head_dim
    if not cache.is_contiguous() or cache.numel() % per_block:
        raise ValueError(f"a paged cache of {tuple(cache.shape)} does not hold whole blocks of {block_size} tokens x "
                         f"2 x {kv_heads} heads x {head_dim}")
    return cache.view(-1).view(cache.numel() // per_block, block_size, 2, kv_heads, head_dim)


def write(view: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at ``slots`` [tokens] (negative slots: padding, skipped)."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    bs = view.shape[1]
    blocks, rows = slots // bs, slots % bs
    view[blocks, rows, 0] = k.to(view.dtype)
    view[blocks, rows, 1] = v.to(view.dtype)


def gather(view: torch.Tensor, block_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` keys and values [length, kv_heads, head_dim] of a request whose blocks are
    ``block_row`` (its row of the block table)."""
    bs = view.shape[1]
    blocks = view[block_row[: math.ceil(length / bs)].long()]  # [n_blocks, bs, 2, kv_heads, d]
    kv = blocks.reshape(-1, *blocks.shape[2:])[:length]
    return kv[:, 0], kv[:, 1]


def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], source: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [queries, heads, d]; keys / values: one [length, kv_heads, d] per key set, over the same positions;
    ``source`` [heads or 1, queries, length] (int): which set a query reads at a key, -1 none. One softmax
    over everything read, float32; a query that reads nothing gives 0. Returns [queries, heads, d]."""
    heads = q.shape[1]
    qf = q.float().transpose(0, 1)  # [heads, queries, d]
    scores, vals = None, []
    for i, (k, v) in enumerate(zip(keys, values)):
        rep = heads // k.shape[1]
        kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, length, d]
        s = (qf @ kf.transpose(1, 2)) * scale
        scores = s if scores is None else torch.where(source == i, s, scores)
        vals.append(v.float().repeat_interleave(rep, dim=1).transpose(0, 1))
    read = (source >= 0).expand_as(scores)
    scores = scores.masked_fill(~read, float("-inf"))
    any_read = read.any(-1, keepdim=True)
    p = torch.where(any_read, torch.softmax(scores.masked_fill(~any_read, 0.0), dim=-1), 0.0)
    out = sum((p * (source == i)) @ v for i, v in enumerate(vals))
    return out.transpose(0, 1).to(q.dtype)


def paged_attention(q: torch.Tensor, views: list[torch.Tensor], query_start: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, choose: Choose, scale: float, out: torch.Tensor) -> None:
    """Every request's queries against its cached keys (the step's own already written): request r's queries
    are rows ``query_start[r]:query_start[r + 1]`` of q [tokens, heads, d], at the last positions of its
    ``seq_lens[r]`` tokens. ``views``: one ``paged_view`` per key set, read through the same block table.
    Writes ``out`` [tokens, heads, d] (rows past the last request's are left as they are)."""
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for r in range(len(lens)):
        a, b, length = starts[r], starts[r + 1], lens[r]
        if b == a:
            continue
        kv = [gather(view, block_table[r], length) for view in views]
        q_pos = torch.arange(length - (b - a), length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        source = choose(q_pos, k_pos, q.shape[1])
        source = source if source.dim() == 3 else source[None]
        out[a:b] = attend(q[a:b], [k for k, _ in kv], [v for _, v in kv], source, scale)


def masked_choice(pred) -> Choose:
    """One key set, read where the mask predicate ``pred(b, h, q_idx, kv_idx)`` (``allhere.masks``) holds
    and the key is not in the future."""

    def choose(q_pos, k_pos, heads):
        h = torch.arange(heads, device=q_pos.device).view(-1, 1, 1)
        allowed = pred(torch.zeros((), dtype=torch.long), h, q_pos[None], k_pos[None]) & (k_pos <= q_pos)[None]
        return torch.where(allowed, 0, -1)

    return choose


def dar_choice(window: int) -> Choose:
    """DAR: set 0 (full-dimensional K/V) for the ``window`` most recent keys, the query's own included; set
    1 (K/V rebuilt from the bottleneck) for older ones."""

    def choose(q_pos, k_pos, heads):
        d = q_pos - k_pos
        return torch.where(d < 0, -1, torch.where(d < window, 0, 1))

    return choose
