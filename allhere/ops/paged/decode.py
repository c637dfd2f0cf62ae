"""The decode rows of ``attention.paged_attention`` (requests with one query this step): each (token, kv head,
class) is one tile of the query heads sharing that kv head, which gathers every block its rule may
read, all of them in one row, and attends them at once under the rule's mask (scores by matmul straight from
the keys as the cache holds them, transposed). A decode step has a few
rows per request and a long key range each: one gather and one call per piece of tiles costs far fewer
operations than the chunked prefill path (``chunks``), whose per-chunk bookkeeping pays off
only where a tile has many rows."""

from __future__ import annotations

import torch

from ...masks.mask import Mask
from ...softmax import NEG_INF, softmax_lse
from .chunks import MAX_GATHER_BYTES, Workspace, gather
from .step_plan import PagedStepPlan, part_of


def decode_rows(qflat, tok, req, pos, row_class, reads, view, block_table, scale: float, softcap: float,
                heads: int, workspace: Workspace) -> list:
    """``tok`` [m]: the decode tokens (one per request), ``req`` / ``pos`` their request and position,
    ``row_class`` [m, heads] (or None). Returns the pieces for ``allhere.softmax.merge_pieces``: (row ids [tiles,
    group], output [tiles, group, d], log-sum-exp [tiles, group])."""
    kv_heads = view.shape[1]
    group = heads // kv_heads
    rows = (tok[:, None] * heads + torch.arange(heads, device=tok.device)).view(-1, kv_heads, group)
    found = []
    for c, parts in enumerate(reads):
        member = torch.ones_like(rows, dtype=torch.bool) if row_class is None else (row_class == c).view(rows.shape)
        t, g = member.any(-1).nonzero(as_tuple=True)  # tiles: (token, kv head) with a row of this class
        if t.numel() == 0:
            continue
        tile_rows = torch.where(member[t, g], rows[t, g], -1)  # [tiles, group]
        heads_t = g[:, None] * group + torch.arange(group, device=tok.device)
        for read in parts:
            found += _attend_read(qflat, tile_rows, heads_t, g, req[t], pos[t], read, view,
                                  block_table, scale, softcap, workspace)
    return found


def _attend_read(qflat, tile_rows, heads_t, kv_head, req, pos, read, view, block_table, scale, softcap, workspace):
    dev = pos.device
    bs, d = view.shape[3], view.shape[4]
    n_blocks = int(pos.max()) // bs + 1
    kl = torch.arange(n_blocks, device=dev) * bs
    ok = kl[None] <= pos[:, None]  # [tiles, blocks]
    test = read.pred.tiles
    if test is not None:
        zero = torch.zeros((), dtype=torch.long, device=dev)
        p = pos[:, None, None]
        ok &= test(zero, heads_t[:, None, :], p, p, kl[None, :, None], kl[None, :, None] + bs - 1).expand(
            *ok.shape, heads_t.shape[1]).any(-1)
    count = ok.sum(1)
    order = torch.argsort(count, stable=True)  # pieces of tiles with similar block counts: little padding
    # each tile's readable blocks first, in order (a stable sort of "not readable")
    cols = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices
    per_tile = 2 * bs * d * view.element_size()
    found = []
    take = max(1, MAX_GATHER_BYTES // (per_tile * max(1, int(count.max()))))  # tiles per piece
    for start in range(0, order.numel(), take):
        idx = order[start:start + take]
        width = int(count[idx[-1]])  # blocks of the piece's widest tile
        if width == 0:
            continue
        j = cols[idx, :width]  # [n, width] block positions in the request
        valid = torch.arange(width, device=dev) < count[idx, None]
        block = torch.where(valid, block_table[req[idx, None], j].long(), 0)
        kt, v = gather(view, block * view.shape[1] + kv_head[idx, None], workspace, transposed=True)
        kpos = (j[:, :, None] * bs + torch.arange(bs, device=dev)).view(idx.numel(), 1, -1)
        qpos = pos[idx, None, None]
        zero = torch.zeros((), dtype=torch.long, device=dev)
        allowed = read.pred(zero, heads_t[idx, :, None], qpos, kpos) & (kpos <= qpos)
        allowed &= valid.repeat_interleave(bs, dim=1)[:, None, :]
        rows = tile_rows[idx]
        o, lse = _attend_t(qflat[rows.clamp_min(0)], kt, v.view(idx.numel(), width * bs, d), allowed, scale, softcap)
        found.append((rows, o, lse))
    return found


def _attend_t(q, kt, v, allowed, scale: float, softcap: float):
    """q [n, group, d] against keys as the cache holds them, kt [n, blocks, d, block_size], and values [n, keys,
    d]: (output [n, group, d], log-sum-exp [n, group] float32, -inf where a row reads nothing). The scores are
    a few per key (a decode row has one query), so they are made by matmul straight from the transposed keys:
    no copy of the keys."""
    n, g, _ = q.shape
    s = torch.matmul(q[:, None].float(), kt.float())  # [n, blocks, group, bs] (float32: no copy in float32)
    s = s.transpose(1, 2).reshape(n, g, -1) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s.masked_fill_(~allowed, NEG_INF)
    p, lse = softmax_lse(s)
    return torch.bmm(p, v.float()).to(q.dtype), lse


def block_kv(view, blocks: torch.Tensor, workspace: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of blocks ``blocks`` [m, w] (the same blocks for every kv head) or [m, kv_heads, w] (each kv head
    its own) of ``view`` (``attention.paged_view``), gathered in one copy (``chunks.gather``), each row's blocks
    side by side: keys as the cache holds them, transposed, [m, kv_heads, d, w x bs], and values [m, kv_heads,
    w x bs, d]."""
    kv_heads, bs, d = view.shape[1], view.shape[3], view.shape[4]
    if blocks.dim() == 2:
        blocks = blocks[:, None].expand(-1, kv_heads, -1)
    m, _, w = blocks.shape
    tiles = blocks * kv_heads + torch.arange(kv_heads, device=blocks.device)[:, None]
    kt, v = gather(view, tiles, workspace, transposed=True)  # [m, kv_heads, w, d, bs], [m, kv_heads, w, bs, d]
    return kt.permute(0, 1, 3, 2, 4).reshape(m, kv_heads, d, w * bs), v.reshape(m, kv_heads, w * bs, d)


def decode_direct(q, tok, req, pos, pred: Mask, view, block_table, scale: float, softcap: float, out,
                  plan: PagedStepPlan | None = None) -> None:
    """The decode tokens ``tok`` [m] (request ``req``, position ``pos``) of a layer whose rows all read one
    predicate (the masked patterns), written straight into ``out`` [tokens, heads, d]: one softmax per row
    over every key it reads, so no log-sum-exp and no merge. All tokens at once, in few operations (the cost
    of a decode step at batch 1 is the number of operations, not the keys): each (token, kv head)'s readable
    blocks (``pred.tiles``, any head of its group: heads that read different blocks, BigBird's random ones,
    cost their own kv head's keys only) gathered in one copy, scores by one matmul from the keys as the cache
    holds them (transposed), the predicate's mask, softmax, one matmul with the values. Scores in float32.
    ``plan``: the step's ``PagedStepPlan``, where which blocks and keys each row reads is kept for the step's
    other layers reading the same ``pred`` (the object: layers of one pattern share it)."""
    m, heads, d = tok.numel(), q.shape[1], q.shape[2]
    kv_heads = view.shape[1]
    blocks, allowed = part_of(plan, ("direct reads", pred, heads, kv_heads, view.shape[3]),
                              lambda: _direct_reads(pred, req, pos, block_table, heads, kv_heads, view.shape[3]))
    kt, v = block_kv(view, blocks, Workspace())
    s = torch.matmul(q[tok].view(m, kv_heads, heads // kv_heads, d).float(), kt.float()) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s.masked_fill_(~allowed, NEG_INF)  # [m, kv_heads, group, keys]
    w = torch.softmax(s, -1).nan_to_num_(0.0)  # a row that reads no key: 0
    out[tok] = torch.matmul(w, v.float()).view(m, heads, d).to(out.dtype)


def _direct_reads(pred: Mask, req, pos, block_table, heads: int, kv_heads: int, bs: int):
    """``decode_direct``'s reads: (blocks [m, kv_heads, width] of each (token, kv head), readable ones first, 0
    past them; allowed [m, kv_heads, group or 1, width x bs] bool: the keys each row reads among them)."""
    m, group, dev = pos.numel(), heads // kv_heads, pos.device
    zero = torch.zeros((), dtype=torch.long, device=dev)
    h = torch.arange(heads, device=dev).view(1, kv_heads, group, 1)
    p = pos.view(m, 1, 1, 1)
    kl = torch.arange(int(pos.max()) // bs + 1, device=dev) * bs
    ok = (kl <= pos[:, None])[:, None].expand(m, kv_heads, kl.numel())  # [m, kv_heads, blocks]
    test = pred.tiles
    if test is not None:
        ok = ok & test(zero, h, p, p, kl, kl + bs - 1).expand(m, kv_heads, group, kl.numel()).any(2)
    count = ok.sum(2)
    width = max(1, int(count.max()))
    cols = torch.sort((~ok).to(torch.int8), dim=2, stable=True).indices[..., :width]  # readable blocks first
    valid = torch.arange(width, device=dev) < count[..., None]  # [m, kv_heads, width]
    blocks = torch.where(valid, block_table[req].long()[:, None].expand(m, kv_heads, -1).gather(2, cols), 0)
    kpos = (cols[..., None] * bs + torch.arange(bs, device=dev)).view(m, kv_heads, 1, -1)
    allowed = pred(zero, h, p, kpos) & (kpos <= p) & valid.repeat_interleave(bs, 2).view(m, kv_heads, 1, -1)
    return blocks, allowed
