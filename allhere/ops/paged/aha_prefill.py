"""AHA's prefill rows over a paged KV cache in a few large calls: the rows of the step's requests with several
queries (prefill, chunked prefill), per request, by torch's fused attention for the CPU.

``paged_attention`` reads a layer's rule tile by tile and block by block (one call per (query tile, kv head, key
block) where a block is read in part), which is general but costs a call per few thousand multiply-adds: a
4,000-token prompt of SmolLM2-135M (9 heads over 3 kv heads of 64, w = 128, one sink) took 4.4x the time of vLLM's
full causal kernel over the same tokens. AHA's two row classes have a shape that needs none of that:

- local rows (the ``window`` most recent keys and the request's first ``n_sinks``): queries in tiles of ``TILE``
  positions; a tile reads the ``window`` positions before it and its own (every window of the tile lies in them)
  and the sinks; all tiles of a request in one call over [tiles, heads, TILE, TILE + window + sinks] with the band
  as a mask (a tile of 128 at w = 256, 8,000 tokens, one core: 0.09 s a layer against 0.15 s for tiles of 256
  reading twice their size). Every head's local row is computed and the global ones dropped (most rows are
  local);
- global rows (every earlier key): per kv head, the query tokens with a global row in that kv head's group, in
  calls of ``GLOBAL_ROWS`` tokens over the request's keys up to the last of them, with the causal mask by position;
  the group's local rows among them dropped.

The keys are gathered once per request, from the blocks through the block table (``attention``'s layout). No soft
cap nor learned sink logits (``paged_attention`` computes those layers). Each (query, key) pair a row reads is read
once: the sink part reads a sink only where the window does not.
"""

from __future__ import annotations

import torch

TILE = 128  # query positions per tile of the local rows (keys: this + the window, and the sinks)
GLOBAL_ROWS = 256  # query tokens per call of a kv head's global rows (each call reads the keys up to its last)


def request_keys(view: torch.Tensor, table_row: torch.Tensor, length: int):
    """(keys, values) [length, kv_heads, d] of one request's first ``length`` positions: its blocks copied whole
    through its block table row from a ``paged_view`` (keys stored transposed per block), then laid out by
    position."""
    bs = view.shape[3]
    blocks = view[table_row[:-(-length // bs)].long()]  # [blocks, kv_heads, 2, bs, d]
    nb, kv_heads, _, _, d = blocks.shape
    k = blocks[:, :, 0].reshape(nb, kv_heads, d, bs).permute(0, 3, 1, 2).reshape(nb * bs, kv_heads, d)
    v = blocks[:, :, 1].permute(0, 2, 1, 3).reshape(nb * bs, kv_heads, d)
    return k[:length], v[:length]


def _sdpa(q, k, v, mask, scale):
    """q [b, heads, m, d]; k, v [b, kv_heads, n, d]; mask [b or 1, 1, m, n] additive (0 / -inf; every row reads
    at least one key)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                             enable_gqa=q.shape[1] != k.shape[1])


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def aha_prefill(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, is_local: torch.Tensor, window: int, n_sinks: int, scale: float,
                out: torch.Tensor) -> torch.Tensor:
    """The rows of the prefill tokens (requests with more than one query this step): q [tokens, heads, d], their
    keys already in the cache; ``is_local`` [tokens, heads] bool (AHA's gate, inverted). Writes those rows of
    ``out`` [tokens, heads, d]; returns a bool [tokens] of the tokens written."""
    starts = query_start.long()
    q_lens = starts[1:] - starts[:-1]
    done = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    kv_heads = view.shape[1]
    group = q.shape[1] // kv_heads
    for r in (q_lens > 1).nonzero().squeeze(1).tolist():
        s, t, length = int(starts[r]), int(q_lens[r]), int(seq_lens[r])
        k, v = request_keys(view, block_table[r], length)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qr, loc = q[s:s + t], is_local[s:s + t]
        pos = torch.arange(length - t, length, device=q.device)
        if bool(loc.any()):
            o = _local(qr, k, v, length - t, window, n_sinks, scale)
            out[s:s + t] = torch.where(loc[..., None], o.to(out.dtype), out[s:s + t])
        glob = ~loc
        for g in range(kv_heads) if bool(glob.any()) else ():
            hs = slice(g * group, (g + 1) * group)
            rows = glob[:, hs].any(1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            for part in rows.split(GLOBAL_ROWS):  # in order of position: each part reads keys up to its last
                end = int(pos[part[-1]]) + 1
                mask = _additive(torch.arange(end, device=q.device)[None] <= pos[part][:, None], q.dtype)
                o = _sdpa(qr[part, hs].transpose(0, 1)[None], k[:end, g][None, None], v[:end, g][None, None],
                          mask[None, None], scale)[0].transpose(0, 1)  # [rows, group, d]
                out[s + part, hs] = torch.where(glob[part, hs][..., None], o.to(out.dtype), out[s + part, hs])
        done[s:s + t] = True
    return done


def band(first: int, t: int, window: int, n_sinks: int, device):
    """The local rows' tiles of one request's chunk (queries at first .. first + t - 1): (key positions [tiles,
    keys], allowed [tiles, TILE, keys] bool, TILE). Tile i (queries from p = first + i x TILE) reads the TILE +
    ``window`` positions p - window .. p + TILE - 1 (outside 0 .. first + t - 1: masked; the caller clamps them),
    every window of the tile lies in them, then the ``n_sinks`` first positions where a window misses them."""
    tiles = -(-t // TILE)
    kpos = (first + TILE * torch.arange(tiles, device=device)[:, None] - window
            + torch.arange(TILE + window, device=device))
    qpos = first + torch.arange(tiles * TILE, device=device).view(tiles, TILE, 1)
    allowed = (kpos[:, None] <= qpos) & (qpos - kpos[:, None] < window) & (kpos[:, None] >= 0)
    if n_sinks:
        spos = torch.arange(n_sinks, device=device)
        allowed = torch.cat([allowed, (spos <= qpos) & (qpos - spos >= window)], 2)
        kpos = torch.cat([kpos, spos.expand(tiles, -1)], 1)
    return kpos, allowed, TILE


def tiled_queries(qr: torch.Tensor, tile: int) -> torch.Tensor:
    """qr [t, heads, d] -> [tiles, heads, tile, d], the last tile padded with zeros."""
    t, heads, d = qr.shape
    qt = qr.new_zeros(-(-t // tile) * tile, heads, d)
    qt[:t] = qr
    return qt.view(-1, tile, heads, d).transpose(1, 2)


def _local(qr, k, v, first: int, window: int, n_sinks: int, scale: float) -> torch.Tensor:
    """Every head's local row of one request's chunk (queries at first .. first + t - 1, keys k, v [first + t,
    kv_heads, d] by position): [t, heads, d]."""
    t, heads, d = qr.shape
    kpos, allowed, tile = band(first, t, window, n_sinks, qr.device)
    idx = kpos.clamp(0, k.shape[0] - 1)
    kt, vt = k[idx], v[idx]  # [tiles, TILE + window + sinks, kv_heads, d]
    o = _sdpa(tiled_queries(qr, tile), kt.permute(0, 2, 1, 3), vt.permute(0, 2, 1, 3),
              _additive(allowed, qr.dtype)[:, None], scale)  # [tiles, heads, tile, d]
    return o.transpose(1, 2).reshape(-1, heads, d)[:t]
