"""DAR's distant keys and values read from a paged cache of latents (Distance-Adaptive Representation, "Dual
Dimensionality for Local and Global Attention", arXiv:2606.18587, Section 5's cache scheme): a token's far
key and value are never stored, only its latent c = h W_down (d_down numbers); each step rebuilds the far keys
of the blocks its rows read and attends them. Plain torch, no vLLM import: ``allhere.serve.vllm_dar`` hands it
vLLM's cache tensor, slot mapping and block table.

- Keys: ``LatentKV.keys(c, positions)`` is the host's own key path on h' = c W_up with W_up absorbed into W_K
  (the host's bias, per-head norm and rotary embedding after it), so a far key costs d_down x kv_dim
  multiply-adds to rebuild. RoPE rotates a key by its position after the projection, so it cannot be folded
  into the query: the keys are rebuilt, in pieces of bounded memory.
- Values need no rebuild: a row's far output is sum_j p_j (W_V' c_j + b) = W_V' (sum_j p_j c_j) + b (the
  weights p sum to 1), so the probabilities weight the latents and one [d, d_down] map per head follows.

Rows: a row (query token, query head) at position p reads far keys j <= p - window (``far_keys``); those of a
request with one query this step (decode) are batched across requests, sorted by length; a request with
several queries (prefill, chunked prefill) is read in (key chunk, query chunk) pieces. Each piece returns (row
ids, output, log-sum-exp) for ``paged_chunks.merge``, which joins them with the near window's pieces under one
softmax. The latent cache layout: ``[blocks, block_size, d_down]`` (a strided view is read where it lies).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .paged_chunks import MAX_GATHER_BYTES

_NEG = float("-inf")


class LatentKV(NamedTuple):
    """How a layer's far keys and values come from latents c [tokens, d_down]."""

    keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (c, positions [tokens]) -> [tokens, kv_heads, d]
    v_weight: torch.Tensor  # [kv_heads, d, d_down]: a far value is v_weight @ c (+ v_bias)
    v_bias: torch.Tensor | None = None  # [kv_heads, d]


def write_latents(view: torch.Tensor, slots: torch.Tensor, c: torch.Tensor) -> None:
    """Store latents c [tokens, d_down] at ``slots`` [tokens] of ``view`` [blocks, block_size, d_down] (negative
    slots: padding, skipped)."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, c = slots[keep], c[keep]
    bs = view.shape[1]
    view[slots.long() // bs, slots.long() % bs] = c.to(view.dtype)


def far_pieces(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, window: int, kv: LatentKV, scale: float,
               budget: int = MAX_GATHER_BYTES) -> list:
    """What each row of ``q`` [tokens, heads, d] reads through the bottleneck: every key j <= its position -
    ``window``, rebuilt from ``view``'s latents through ``block_table`` (request r's queries are rows
    ``query_start[r]:query_start[r + 1]``, the last of its ``seq_lens[r]`` tokens, whose latents are written).
    Returns pieces (row ids [n, size], output [n, size, d], log-sum-exp [n, size]) for ``paged_chunks.merge``;
    ``budget``: bytes of rebuilt keys, latents and scores held at once (about)."""
    starts, lens = query_start.long(), seq_lens.long()
    q_len = starts[1:] - starts[:-1]
    far = torch.where(q_len > 0, (lens - window).clamp_min(0), 0)  # keys read far by the request's last row
    heads, kv_heads = q.shape[1], kv.v_weight.shape[0]
    per_token = 4 * (view.shape[2] + kv_heads * q.shape[2] + heads)  # a latent, its key, a score per head
    chunk = max(view.shape[1], budget // per_token // view.shape[1] * view.shape[1])  # keys per piece
    found = []
    one = (q_len == 1) & (far > 0)
    if bool(one.any()):
        found += _decode(q, view, starts, far, block_table, one.nonzero().flatten(), kv, scale, chunk)
    for r in ((q_len > 1) & (far > 0)).nonzero().flatten().tolist():
        found += _prefill(q, view, int(starts[r]), int(q_len[r]), int(lens[r]), block_table[r], window, kv, scale,
                          chunk)
    return found


def _rebuild(view, blocks, first: int, count: int, kv: LatentKV):
    """Latents [n, count, d_down] and their keys [n, count, kv_heads, d] of tokens ``first .. first + count``
    of the requests whose blocks are ``blocks`` [n, >= their last block + 1]."""
    bs = view.shape[1]
    b0, b1 = first // bs, -(-(first + count) // bs)
    c = view[blocks[:, b0:b1].long()].flatten(1, 2)[:, first - b0 * bs: first - b0 * bs + count]  # [n, count, dd]
    n = c.shape[0]
    pos = torch.arange(first, first + count, device=c.device).repeat(n)
    return c, kv.keys(c.reshape(n * count, -1), pos).view(n, count, kv.v_weight.shape[0], -1)


def _attend(q, k, c, allowed, kv: LatentKV, scale: float):
    """q [n, kv_heads, m, d] (m: rows per kv head) against keys k [n, kv_heads, d, keys] and latents c [n, keys,
    d_down] under ``allowed`` [n, 1, m or 1, keys]: (output [n, kv_heads, m, d], log-sum-exp [n, kv_heads, m])."""
    s = torch.matmul(q.float(), k.float()) * scale
    s.masked_fill_(~allowed, _NEG)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    n, g, m, keys = p.shape
    pc = torch.bmm(p.view(n, g * m, keys), c.float()).view(n, g, m, -1)  # the probabilities weight the latents
    o = torch.matmul(pc, kv.v_weight.float().transpose(1, 2))  # [n, kv_heads, m, d]
    if kv.v_bias is not None:
        o = o + kv.v_bias.float()[:, None, :]  # where a row reads nothing its lse is -inf: merge gives it no weight
    return o, lse


def _decode(q, view, starts, far, block_table, reqs, kv: LatentKV, scale: float, chunk: int) -> list:
    """Requests ``reqs`` with one query each: batched, sorted by how many far keys they read."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = kv.v_weight.shape[0]
    reqs = reqs[torch.argsort(far[reqs], stable=True)]
    widest = int(far[reqs[-1]])
    take = max(1, chunk // max(1, widest))  # requests per piece
    found = []
    for i in range(0, reqs.numel(), take):
        idx = reqs[i:i + take]
        n, width = idx.numel(), int(far[idx[-1]])
        rows = starts[idx][:, None] * heads + torch.arange(heads, device=q.device)  # [n, heads]
        qr = q[starts[idx]].view(n, kv_heads, heads // kv_heads, d)
        for first in range(0, width, chunk):  # one request wider than a piece: its keys in chunks
            count = min(chunk, width - first)
            c, k = _rebuild(view, block_table[idx], first, count, kv)
            allowed = (torch.arange(first, first + count, device=q.device) < far[idx, None])[:, None, None]
            o, lse = _attend(qr, k.permute(0, 2, 3, 1), c, allowed, kv, scale)
            found.append((rows, o.reshape(n, heads, d), lse.reshape(n, heads)))
    return found


def _prefill(q, view, start: int, q_len: int, length: int, blocks, window: int, kv: LatentKV, scale: float,
             chunk: int) -> list:
    """One request's ``q_len`` queries (rows ``start ..``, positions ``length - q_len ..``) against its far keys,
    in pieces of ``chunk`` keys by about as many (query, head) rows."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = kv.v_weight.shape[0]
    group = heads // kv_heads
    dev = q.device
    first_pos = length - q_len
    q_chunk = max(1, chunk // heads)
    found = []
    for k0 in range(0, length - window, chunk):
        count = min(chunk, length - window - k0)
        c, k = _rebuild(view, blocks[None], k0, count, kv)
        kt = k[0].permute(1, 2, 0)[None]  # [1, kv_heads, d, count]
        kpos = torch.arange(k0, k0 + count, device=dev)
        t0 = max(0, k0 + window - first_pos)  # the first query that reads a key of this chunk
        for t in range(t0, q_len, q_chunk):
            m = min(q_chunk, q_len - t)
            qpos = torch.arange(first_pos + t, first_pos + t + m, device=dev)
            qt = q[start + t: start + t + m].view(m, kv_heads, group, d).permute(1, 2, 0, 3).reshape(
                1, kv_heads, group * m, d)
            allowed = (kpos[None] <= qpos[:, None] - window).repeat(group, 1)[None, None]  # [1, 1, group x m, keys]
            o, lse = _attend(qt, kt, c, allowed, kv, scale)
            rows = ((start + t + torch.arange(m, device=dev))[:, None] * heads
                    + torch.arange(heads, device=dev)).view(m, kv_heads, group).permute(1, 2, 0).reshape(1, -1)
            found.append((rows, o.reshape(1, -1, d), lse.reshape(1, -1)))
    return found
