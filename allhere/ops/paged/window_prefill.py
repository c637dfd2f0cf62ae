"""The window part of a prefill over a paged KV cache in a few large calls, as pieces to merge: for every request
with several queries this step, each query's last ``window`` keys (itself included), with each row's
log-sum-exp, so that a mechanism reading more keys elsewhere (DAR's distant keys rebuilt from latents:
``dar_far.far_pieces``) joins them under one softmax (``allhere.softmax.merge_pieces`` / ``chunks.Merger``).

The tiling is AHA's local rows' (``aha_prefill.band``): tiles of TILE queries, each reading the ``window`` keys
before it and its own, every tile of a request in one call of torch's fused flash attention for
the CPU with the band as a mask (it returns the log-sum-exp). The general tiled path (``chunks.attend_part``)
reads the same keys in a call per (query tile, kv head, key block): an 8,000-token prompt of a 4-layer GQA model
(4 heads of 64 over 2, w = 256) spent 0.66 s there, against 0.87 s in vLLM's kernel for the plain model's whole
causal prefill; one layer's windows, one core: 0.20-0.30 s that way, 0.11-0.15 s this way.

Only the blocks a query's window can reach are gathered: a sliding-window cache (vLLM frees the blocks behind
the window between a chunked prefill's chunks) is read where it still holds keys.
"""

from __future__ import annotations

import torch

from ...softmax import NEG_INF
from . import chunks
from .aha_prefill import band, request_keys, tiled_queries


def window_pieces(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, window: int, scale: float):
    """Yields, per request with more than one query (rows ``query_start[r]:query_start[r + 1]``, the last of its
    ``seq_lens[r]`` tokens, their keys already in ``view``, a ``paged_view`` read through ``block_table``): (row
    ids [1, t x heads] (``token x heads + head``), output [1, t x heads, d], log-sum-exp [1, t x heads] fp32) of
    its queries against their windows. q [tokens, heads, d]."""
    starts = query_start.long()
    q_lens = starts[1:] - starts[:-1]
    heads, d = q.shape[1], q.shape[2]
    bs = view.shape[3]
    for r in (q_lens > 1).nonzero().flatten().tolist():
        s, t, length = int(starts[r]), int(q_lens[r]), int(seq_lens[r])
        first = length - t
        kpos, allowed, tile = band(first, t, window, 0, q.device)
        b0 = max(0, first - window) // bs  # no window reaches behind this block
        k, v = request_keys(view, block_table[r, b0:], length - b0 * bs)
        idx = (kpos - b0 * bs).clamp(0, k.shape[0] - 1)
        kt, vt = (x[idx].to(q.dtype).permute(0, 2, 1, 3) for x in (k, v))  # [tiles, kv_heads, TILE + window, d]
        qt = tiled_queries(q[s:s + t], tile)  # [tiles, heads, tile, d]
        if q.is_cpu and chunks.FUSED:
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, NEG_INF)
            o, lse = chunks._flash(qt, kt, vt, 0.0, False, attn_mask=mask[:, None], scale=scale)
        else:
            group = heads // kt.shape[1]
            kt, vt = (x.float().repeat_interleave(group, 1) for x in (kt, vt))
            sc = torch.matmul(qt.float(), kt.transpose(-1, -2)).mul_(scale).masked_fill_(~allowed[:, None], NEG_INF)
            lse = torch.logsumexp(sc, -1)
            o = torch.matmul(torch.softmax(sc, -1), vt)
        o = o.transpose(1, 2).reshape(-1, heads, d)[:t]  # [t, heads, d]
        lse = lse.float().transpose(1, 2).reshape(-1, heads)[:t]
        ids = torch.arange(s * heads, (s + t) * heads, device=q.device)
        yield ids[None], o.reshape(1, t * heads, d), lse.reshape(1, t * heads)
