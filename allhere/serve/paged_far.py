"""DAR's distant keys and values read from a paged cache of latents (Distance-Adaptive Representation, "Dual
Dimensionality for Local and Global Attention", arXiv:2606.18587, Section 5's cache scheme): a token's far
key and value are never stored, only its latent c = h W_down (d_down numbers); each step rebuilds the far keys
of the blocks its rows read and attends them. Plain torch, no vLLM import: ``allhere.serve.vllm_dar`` hands it
vLLM's cache tensor, slot mapping and block table.

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
keys among many rows: a chunk of them is rebuilt once, with its values, into paged blocks of the workspace and
read as the near window is (``paged.paged_pieces``: tiles, torch's fused attention). Each piece returns (row
ids, output, log-sum-exp) for ``paged_chunks.merge``, which joins them with the near window's pieces under one
softmax. The latent cache's layout: ``[blocks, block_size, d_down]`` (a strided view is read where it lies).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..masks import Mask, and_masks
from ..mechanisms.dar import far_keys
from ..ops.dar_latent.check import query_rows
from .paged import Read, paged_pieces, paged_view, write
from .paged_chunks import Workspace

_NEG = float("-inf")
SCRATCH_BLOCK = 128  # tokens per block of a prefill's rebuilt far keys and values
FAR_BUDGET = 8 << 20  # bytes of a piece of rebuilt keys: a piece read from the CPU's caches right after the GEMM
# wrote it (decode of 16 x 8k keys, one core: 95 ms at 8 MB, 138 ms at 32 MB; benchmarks/serve_paged_op.py)


class LatentKV(NamedTuple):
    """How a layer's far keys and values come from latents."""

    keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (c [n, keys, d_down], positions [keys]) -> keys
    # [n, keys, kv_heads, d], their head dimension in the order ``q_order`` (the same positions for every n)
    v_weight: torch.Tensor  # [kv_heads, d, d_down]: a far value is v_weight @ c (+ v_bias)
    v_bias: torch.Tensor | None = None  # [kv_heads, d]
    q_order: torch.Tensor | None = None  # [d]: the keys' head dimension is the queries' in this order (None: same)
    # (w_uk [kv_heads, e_c, d_c], e_r): a decode row reads the latent rows [c ; k^R of every KV head] absorbed
    # (``dar_latent``: its query [q^R ; q^C] folded into a row, nothing rebuilt), not through ``keys``
    absorbed: tuple[torch.Tensor, int] | None = None


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
               budget: int = FAR_BUDGET, workspace: Workspace | None = None):
    """What each row of ``q`` [tokens, heads, d] reads through the bottleneck: every key j <= its position -
    ``window``, rebuilt from ``view``'s latents through ``block_table`` (request r's queries are rows
    ``query_start[r]:query_start[r + 1]``, the last of its ``seq_lens[r]`` tokens, whose latents are written).
    Yields pieces (row ids [n, size], output [n, size, d], log-sum-exp [n, size]) for ``paged_chunks.merge`` /
    ``Merger`` as they are computed (a prefill's rebuilt keys are overwritten chunk by chunk: consume in turn);
    ``budget``: bytes of rebuilt keys, latents and scores held at once (about); ``workspace``: memory reused
    across calls for a prefill's rebuilt keys and values (``paged_chunks.Workspace``)."""
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
        yield from _decode(q, view, starts, far, block_table, one.nonzero().flatten(), kv, scale, chunk)
    workspace = workspace or Workspace()
    chunk = max(SCRATCH_BLOCK, chunk // SCRATCH_BLOCK * SCRATCH_BLOCK)
    for r in ((q_len > 1) & (far > 0)).nonzero().flatten().tolist():
        yield from _prefill(q, view, int(starts[r]), int(q_len[r]), int(lens[r]), block_table[r], window, kv, scale,
                            chunk, workspace)


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


def _attend_absorbed(q, c, allowed, kv: LatentKV, scale: float):
    """``_attend`` for latent rows c [n, keys, d_c + kv_heads x e_r] (``LatentKV.absorbed``): a head's query
    becomes a row, [q^C W_UK_g ; q^R in its KV head's slot, zeros elsewhere], read against the rows in their dtype
    (one matmul, rows @ q^T: torch's CPU matmul copies a transposed bf16 operand); scores normalised in fp32."""
    n, g, m, _ = q.shape
    q_row = query_rows(q, *kv.absorbed, c.dtype).view(n, g * m, -1)
    s = torch.bmm(c, q_row.transpose(1, 2)).transpose(1, 2).float().mul_(scale).view(n, g, m, -1)
    return _weigh(s, c, allowed, kv)


def _weigh(s, c, allowed, kv: LatentKV):
    """Scores s [n, kv_heads, m, keys] (fp32, scaled) -> (output [n, kv_heads, m, d] fp32, log-sum-exp): the
    probabilities weight the latents c [n, keys, width] in their dtype, then one [d, width] map per KV head."""
    if allowed is not None:
        s.masked_fill_(~allowed, _NEG)
    lse = torch.logsumexp(s, -1)
    p = s.sub_(lse.clamp_min(torch.finfo(torch.float32).min)[..., None]).exp_()
    n, g, m, keys = p.shape
    if allowed is not None:
        c = c.masked_fill(~allowed.any(2)[:, 0, :, None], 0)  # 0 x a stale inf in an unread slot is NaN
    pc = torch.bmm(p.to(c.dtype).view(n, g * m, keys), c).view(n, g, m, -1).float()  # weighted latents
    o = torch.matmul(pc, kv.v_weight.float().transpose(1, 2))  # [n, kv_heads, m, d]
    if kv.v_bias is not None:
        o = o + kv.v_bias.float()[:, None, :]  # where a row reads nothing its lse is -inf: merge gives it no weight
    return o, lse


def _decode(q, view, starts, far, block_table, reqs, kv: LatentKV, scale: float, chunk: int) -> list:
    """Requests ``reqs`` with one query each: batched, sorted by how many far keys they read."""
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
        qr = q[starts[idx]].view(n, kv_heads, heads // kv_heads, d)
        for first in range(0, width, chunk):  # one request wider than a piece: its keys in chunks
            count = min(chunk, width - first)
            allowed = None  # every request of the piece reads all these keys
            if narrowest < first + count:
                allowed = (torch.arange(first, first + count, device=q.device) < far[idx, None])[:, None, None]
            if kv.absorbed is None:
                c, k = _rebuild(view, block_table[idx], first, count, kv)
                o, lse = _attend(qr, k, c, allowed, kv, scale)
            else:
                o, lse = _attend_absorbed(qr, _latents(view, block_table[idx], first, count), allowed, kv, scale)
            found.append((rows, o.reshape(n, heads, d), lse.reshape(n, heads)))
    return found


def _prefill(q, view, start: int, q_len: int, length: int, blocks, window: int, kv: LatentKV, scale: float,
             chunk: int, workspace: Workspace):
    """One request's ``q_len`` queries (rows ``start ..``, positions ``length - q_len ..``) against its far keys:
    many rows read the same keys, so the keys and values of a chunk of ``chunk`` tokens are rebuilt once into
    paged blocks of the workspace and read as the near window is, tile by tile in torch's fused attention.
    Yields the pieces chunk by chunk."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = kv.v_weight.shape[0]
    dev = q.device
    qr = q[start:start + q_len]
    v_weight = kv.v_weight.reshape(kv_heads * d, -1)
    v_bias = None if kv.v_bias is None else kv.v_bias.reshape(-1)
    for k0 in range(0, length - window, chunk):
        count = min(chunk, length - window - k0)
        c, k = _rebuild(view, blocks[None], k0, count, kv)
        v = torch.nn.functional.linear(c[0].float(), v_weight.float(), None if v_bias is None else v_bias.float())
        n_blocks = -(-count // SCRATCH_BLOCK)
        scratch = paged_view(workspace.take("far", (n_blocks, kv_heads, SCRATCH_BLOCK, 2 * d), qr), SCRATCH_BLOCK,
                             kv_heads, d)  # in the queries' dtype, as the fused attention reads it
        scratch[-1].zero_()  # the last block's unwritten slots are read under the mask: no stale NaN in them
        write(scratch, torch.arange(count, device=dev), k[0], v.view(count, kv_heads, d))
        table = torch.zeros(1, (k0 + count - 1) // SCRATCH_BLOCK + 1, dtype=torch.long, device=dev)
        table[0, k0 // SCRATCH_BLOCK:] = torch.arange(n_blocks, device=dev)
        read = Read(_far_range(window, k0, k0 + count), SCRATCH_BLOCK * 2)
        for rows, o, lse in paged_pieces(qr, scratch, torch.tensor([0, q_len], device=dev),
                                         torch.tensor([length], device=dev), table, [[read]], scale,
                                         workspace=workspace):
            yield torch.where(rows >= 0, rows + start * heads, -1), o, lse


def _far_range(window: int, lo: int, hi: int) -> Mask:
    """``far_keys(window)`` restricted to keys ``lo <= j < hi``, block tests and all."""

    def pred(b, h, q_idx, kv_idx):
        return (kv_idx >= lo) & (kv_idx < hi)

    def tiles(b, h, ql, qh, kl, kh):  # exact: some key of [kl, kh] in range
        return (kh >= lo) & (kl < hi)

    def dense(b, h, ql, qh, kl, kh):  # exact: every key in range
        return (kl >= lo) & (kh < hi)

    return and_masks(far_keys(window), Mask(pred, tiles, dense, name=f"keys_{lo}_{hi}"))
