"""DAR's distant keys and values read from a paged cache of latents (Distance-Adaptive Representation, "Dual
Dimensionality for Local and Global Attention", arXiv:2606.18587, Section 5's cache scheme): a token's far
key and value are never stored, only its latent c = h W_down (d_down numbers); each step rebuilds the far keys
of the blocks its rows read and attends them. Plain torch: a served layer (vLLM's: ``allhere.serve.vllm.dar``) hands
it the engine's cache tensor, slot mapping and block table.

- Keys: ``LatentKV.keys(c, positions)`` is the host's own key path on h' = c W_up with W_up absorbed into W_K
  (the host's bias, per-head norm and rotary embedding after it), so a far key costs d_down x kv_dim
  multiply-adds to rebuild. RoPE rotates a key by its position after the projection, so it cannot be folded
  into the query: the keys are rebuilt, in pieces of bounded memory.
- Values need no rebuild for a decode row: its far output is sum_j p_j (W_V' c_j + b) = W_V' (sum_j p_j c_j) +
  b (the weights p sum to 1), so the probabilities weight the latents and one [d, d_down] map per head
  follows. A prefill's rows share their keys and values, which are rebuilt once per chunk (below).

Rows: a row (query token, query head) at position p reads far keys j <= p - window (``far_keys``). Those of a
request with one query this step (decode) are batched across requests, sorted by length, each piece's keys
rebuilt for it and scored by matmul. A request with several queries (prefill, chunked prefill) shares its far
keys among many rows: they are rebuilt once, with their values, and read by torch's fused CPU attention, the keys
every query reads unmasked and the last ones causally. Each piece returns (row ids, output, log-sum-exp) for
``allhere.softmax.merge_pieces``, which joins them with the near window's pieces under one softmax. The latent
cache's layout: ``[blocks, block_size, d_down]`` (a strided view is read where it lies).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...softmax import NEG_INF, softmax_lse
from . import chunks
from .step_plan import slot_places

FAR_BUDGET = 8 << 20  # bytes of a piece of rebuilt keys: a piece read from the CPU's caches right after the GEMM
# wrote it (decode of 16 x 8k keys, one core: 95 ms at 8 MB, 138 ms at 32 MB; benchmarks/serve_paged_op.py)


class LatentKV(NamedTuple):
    """How a layer's far keys and values come from latents."""

    keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (c [n, keys, d_down], positions [keys]) -> keys
    # [n, keys, kv_heads, d], their head dimension in the order ``q_order`` (the same positions for every n)
    v_weight: torch.Tensor  # [kv_heads, d, d_v]: a far value is v_weight @ c[:d_v] (+ v_bias): the latent's first
    # d_v numbers (all of them for DAR; dar_latent's rows [c ; k^R] carry the rotated keys after them)
    v_bias: torch.Tensor | None = None  # [kv_heads, d]
    q_order: torch.Tensor | None = None  # [d]: the keys' head dimension is the queries' in this order (None: same)


def rotary_projection(weight: torch.Tensor, bias: torch.Tensor | None, kv_heads: int,
                      rotary: tuple[torch.Tensor, bool] | None = None, norm: Callable | None = None):
    """Keys RoPE(norm(x W^T + b)) for ``LatentKV.keys``, made for reading: returns (keys, order) where ``keys(x
    [n, tokens, in], positions [tokens])`` gives float32 keys [n, tokens, kv_heads, d] with their head dimension
    in ``order`` (None: as is). ``weight`` [kv_heads x d, in], ``bias`` [kv_heads x d] or None; ``norm``: per-head
    norm on [..., d] (before the rotation); ``rotary``: (table [positions, r / 2] complex, cos + i sin of each
    rotated pair, the first r dimensions rotated; neox) or None. The rotation is one complex multiply in place:
    the pairs it rotates must be adjacent, which they are in GPT-J's layout; in GPT-NeoX's (pair (i, i + r / 2))
    the weight's rows are put in ``order`` instead (after the norm where there is one), and the queries must be
    read in ``order`` too (``LatentKV.q_order``)."""
    kv, _ = weight.shape
    d = kv // kv_heads
    order = None
    if rotary is not None and rotary[1]:
        half = torch.arange(rotary[0].shape[1], device=weight.device)
        order = torch.cat([torch.stack([half, half + half.numel()], -1).flatten(),
                           torch.arange(2 * half.numel(), d, device=weight.device)])
    if norm is None and order is not None:
        rows = (torch.arange(kv_heads, device=weight.device)[:, None] * d + order).flatten()
        weight, bias = weight[rows], (None if bias is None else bias[rows])

    def keys(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n, tokens = x.shape[:2]
        k = torch.nn.functional.linear(x.reshape(n * tokens, -1).to(weight.dtype), weight, bias)  # every kv head
        if norm is not None:
            k = norm(k.view(-1, d))
            if order is not None:
                k = k.view(-1, d)[:, order]
        k = k.float().view(n, tokens, kv_heads, d)
        if rotary is not None:
            r = 2 * rotary[0].shape[1]
            torch.view_as_complex(k[..., :r].unflatten(-1, (r // 2, 2))).mul_(rotary[0][positions][:, None])
        return k

    return keys, order


def write_latents(view: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, places=None) -> None:
    """Store latents c [tokens, d_down] at ``slots`` [tokens] of ``view`` [blocks, block_size, d_down] (negative
    slots: padding, skipped). ``places``: the slots' ``step_plan.slot_places``, where the caller has them."""
    kept, blocks, rows = places or slot_places(slots, view.shape[1])
    view[blocks, rows] = (c if kept is None else c[kept]).to(view.dtype)


def far_pieces(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, window: int, kv: LatentKV, scale: float,
               budget: int = FAR_BUDGET, absorbed: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """What each row of ``q`` [tokens, heads, d] reads through the bottleneck: every key j <= its position -
    ``window``, rebuilt from ``view``'s latents through ``block_table`` (request r's queries are rows
    ``query_start[r]:query_start[r + 1]``, the last of its ``seq_lens[r]`` tokens, whose latents are written).
    Yields pieces (row ids [n, size], output [n, size, d], log-sum-exp [n, size]) for
    ``allhere.softmax.merge_pieces`` / ``Merger`` as they are computed; ``budget``: bytes of rebuilt keys, latents
    and scores held at once (about; a prefill's last far keys, as many as its queries, are rebuilt at once).
    ``absorbed`` (``dar_latent``, whose latents are rows [c ; k^R of every KV head]): token ids [k] -> their queries
    as cache rows [k, heads, width] (``ops.dar_latent.query_map``); a decode row then reads the rows absorbed,
    nothing rebuilt, not through ``kv.keys``."""
    starts, lens = query_start.long(), seq_lens.long()
    q_len = starts[1:] - starts[:-1]
    if kv.q_order is not None:
        q = q[..., kv.q_order]
    far = torch.where(q_len > 0, (lens - window).clamp_min(0), 0)  # keys read far by the request's last row
    heads, kv_heads = q.shape[1], kv.v_weight.shape[0]
    per_token = 4 * (view.shape[2] + kv_heads * q.shape[2] + heads)  # a latent, its key, a score per head
    chunk = max(view.shape[1], budget // per_token // view.shape[1] * view.shape[1])  # keys per piece
    one = (q_len == 1) & (far > 0)
    if bool(one.any()):
        yield from _decode(q, view, starts, far, block_table, one.nonzero().flatten(), kv, scale, chunk, absorbed)
    for r in ((q_len > 1) & (far > 0)).nonzero().flatten().tolist():
        yield from _prefill(q, view, int(starts[r]), int(q_len[r]), int(lens[r]), block_table[r], window, kv, scale,
                            chunk)


def _latents(view, blocks, first: int, count: int) -> torch.Tensor:
    """Latents [n, count, d_down] of tokens ``first .. first + count`` of the requests whose blocks are ``blocks``
    [n, >= their last block + 1]."""
    bs = view.shape[1]
    b0, b1 = first // bs, -(-(first + count) // bs)
    n = blocks.shape[0]
    c = view.index_select(0, blocks[:, b0:b1].reshape(-1).long()).view(n, -1, view.shape[2])  # [n, blocks x bs, dd]
    return c[:, first - b0 * bs: first - b0 * bs + count]


def _rebuild(view, blocks, first: int, count: int, kv: LatentKV):
    """``_latents`` and their keys [n, count, kv_heads, d]."""
    c = _latents(view, blocks, first, count)
    return c, kv.keys(c, torch.arange(first, first + count, device=c.device))


def _attend(q, k, c, allowed, kv: LatentKV, scale: float):
    """q [n, kv_heads, m, d] (m: rows per kv head) against keys k [n, keys, kv_heads, d] and latents c [n, keys,
    d_down] under ``allowed`` [n, 1, m or 1, keys] (None: every key): (output [n, kv_heads, m, d], log-sum-exp
    [n, kv_heads, m])."""
    q = q.float()  # per kv head: its keys read where they lie, a transposed operand (no copy)
    s = torch.stack([torch.matmul(q[:, h], k[:, :, h].transpose(1, 2)) for h in range(k.shape[2])], 1).mul_(scale)
    return _weigh(s, c.float(), allowed, kv)


def _attend_absorbed(q_row, c, allowed, kv: LatentKV, scale: float):
    """``_attend`` for latent rows c [n, keys, d_c + kv_heads x e_r] read absorbed: q_row [n, kv_heads, m, width],
    a head's query as a row [q^C W_UK_g ; q^R in its KV head's slot, zeros elsewhere], read against the rows in
    their dtype (one matmul, rows @ q^T: torch's CPU matmul copies a transposed bf16 operand); scores normalised in
    fp32."""
    n, g, m, _ = q_row.shape
    s = torch.bmm(c, q_row.to(c.dtype).view(n, g * m, -1).transpose(1, 2)).transpose(1, 2)
    s = s.float().mul_(scale).view(n, g, m, -1)
    return _weigh(s, c, allowed, kv)


def _weigh(s, c, allowed, kv: LatentKV):
    """Scores s [n, kv_heads, m, keys] (fp32, scaled) -> (output [n, kv_heads, m, d] fp32, log-sum-exp): the
    probabilities weight the latents c [n, keys, >= d_v] (their first d_v numbers, in their dtype), then one
    [d, d_v] map per KV head."""
    if allowed is not None:
        s.masked_fill_(~allowed, NEG_INF)
    p, lse = softmax_lse(s, inplace=True)
    n, g, m, keys = p.shape
    c = c[..., :kv.v_weight.shape[2]]  # a strided view: bmm reads it where it lies
    if allowed is not None:
        c = c.masked_fill(~allowed.any(2)[:, 0, :, None], 0)  # 0 x a stale inf in an unread slot is NaN
    pc = torch.bmm(p.to(c.dtype).view(n, g * m, keys), c).view(n, g, m, -1).float()  # weighted latents
    o = torch.matmul(pc, kv.v_weight.float().transpose(1, 2))  # [n, kv_heads, m, d]
    if kv.v_bias is not None:
        o = o + kv.v_bias.float()[:, None, :]  # where a row reads nothing its lse is -inf: merge gives it no weight
    return o, lse


def _decode(q, view, starts, far, block_table, reqs, kv: LatentKV, scale: float, chunk: int, absorbed) -> list:
    """Requests ``reqs`` with one query each: batched, sorted by how many far keys they read (``absorbed``: as
    ``far_pieces``)."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = kv.v_weight.shape[0]
    reqs = reqs[torch.argsort(far[reqs], stable=True)]
    widths = far[reqs].tolist()
    found = []
    i = 0
    while i < len(widths):  # a piece: the next requests while all of them, as wide as its widest, fit ``chunk``
        j = i + 1
        while j < len(widths) and (j + 1 - i) * widths[j] <= chunk:
            j += 1
        idx, narrowest, width, i = reqs[i:j], widths[i], widths[j - 1], j
        n = idx.numel()
        rows = starts[idx][:, None] * heads + torch.arange(heads, device=q.device)  # [n, heads]
        qr = (q[starts[idx]] if absorbed is None else absorbed(starts[idx])).view(n, kv_heads, heads // kv_heads, -1)
        for first in range(0, width, chunk):  # one request wider than a piece: its keys in chunks
            count = min(chunk, width - first)
            allowed = None  # every request of the piece reads all these keys
            if narrowest < first + count:
                allowed = (torch.arange(first, first + count, device=q.device) < far[idx, None])[:, None, None]
            if absorbed is None:
                c, k = _rebuild(view, block_table[idx], first, count, kv)
                o, lse = _attend(qr, k, c, allowed, kv, scale)
            else:
                o, lse = _attend_absorbed(qr, _latents(view, block_table[idx], first, count), allowed, kv, scale)
            found.append((rows, o.reshape(n, heads, d), lse.reshape(n, heads)))
    return found


def _prefill(q, view, start: int, q_len: int, length: int, blocks, window: int, kv: LatentKV, scale: float,
             chunk: int):
    """One request's ``q_len`` queries (rows ``start ..``, positions ``length - q_len ..``) against its far keys:
    many rows read the same keys, so they are rebuilt once, with their values, and read by torch's fused CPU
    attention. Query i reads far keys 0 .. n - q_len + i of the n = length - window there are: the keys before
    n - q_len are read by every query (no mask, ``chunk`` keys at a time), the last q_len causally (one call).
    Yields the pieces chunk by chunk."""
    n = length - window
    first = max(0, q_len - n)  # the first query that reads a far key
    qr = q[start + first:start + q_len].transpose(0, 1)[None]  # [1, heads, rows, d]
    diagonal = max(0, n - q_len)
    for k0 in range(0, diagonal, chunk):
        yield _far_piece(qr, view, blocks, k0, min(chunk, diagonal - k0), kv, scale, start + first, False)
    yield _far_piece(qr, view, blocks, diagonal, n - diagonal, kv, scale, start + first, True)


def _far_piece(qr, view, blocks, first: int, count: int, kv: LatentKV, scale: float, row0: int, causal: bool):
    """The queries qr [1, heads, rows, d] (rows ``row0 ..``) against the far keys ``first .. first + count``,
    rebuilt with their values (causal: query i reads the first i + 1 of them; else all): one piece."""
    kv_heads, heads, d = kv.v_weight.shape[0], qr.shape[1], qr.shape[3]
    c, k = _rebuild(view, blocks[None], first, count, kv)
    w_v = kv.v_weight.reshape(kv_heads * d, -1).float()
    v = torch.nn.functional.linear(c[0, :, :w_v.shape[1]].float(), w_v,
                                   None if kv.v_bias is None else kv.v_bias.reshape(-1).float())
    k, v = (t.view(count, kv_heads, d).transpose(0, 1)[None].to(qr.dtype) for t in (k[0], v))
    out, lse = _attend_far(qr, k, v, causal, scale)
    rows = qr.shape[2]
    ids = ((row0 + torch.arange(rows, device=qr.device))[:, None] * heads + torch.arange(heads, device=qr.device))
    return ids.view(1, -1), out[0].transpose(0, 1).reshape(1, rows * heads, d), lse[0].t().reshape(1, -1)


def _attend_far(qr, k, v, causal: bool, scale: float):
    """qr [1, heads, rows, d] against k, v [1, kv_heads, keys, d] (query head i reads KV head i // (heads /
    kv_heads); causal: query i reads keys 0..i): (output [1, heads, rows, d], log-sum-exp [1, heads, rows] fp32).
    torch's fused flash attention on the CPU; elsewhere (or ``chunks.FUSED`` False) matmuls in fp32."""
    if qr.is_cpu and chunks.FUSED:
        out, lse = chunks._flash(qr, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    group = qr.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, 1) for t in (k, v))
    s = torch.matmul(qr.float(), k.transpose(-1, -2)).mul_(scale)
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), NEG_INF)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.softmax(s, -1), v).to(qr.dtype), lse
