"""The prefill work of ``attention.paged_attention`` (query tiles, the key blocks each reads, their attention in few
fused calls) and what both paths share: the gather of blocks, the workspace, the merge of a
row's pieces by log-sum-exp as they come (``Merger``, on ``allhere.softmax.merge_pieces``). Plain torch."""

from __future__ import annotations

import torch

from ...masks.mask import Mask
from ...softmax import NEG_INF, merge_pieces, softmax_lse

MAX_GATHER_BYTES = 32 << 20  # keys and values gathered for one call (a longer batch runs in pieces)
MAX_MASK_ELEMENTS = 4 << 20  # (row, key) pairs of the predicate evaluated at once
MERGE_BUDGET = 64 << 20  # bytes of pieces (outputs, log-sum-exps, row ids) held before they are merged
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FUSED = True  # torch's fused flash attention on the CPU; False (or another device, or capped scores): matmuls


class Workspace:
    """Memory reused from call to call for the gathered keys and values: a fresh allocation of tens of MB is
    mapped anew by the allocator and page-faults on every first touch, which costs more than the copy."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        key = (name, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)


class Tiles:
    """Query tiles of one size: per tile [tiles, size] the row ids ``row`` (token x heads + head; -1: padding),
    heads ``head``, positions ``pos`` (-1: padding) and queries ``q`` [tiles, size, d]; per tile its ``req``,
    ``kv_head``, first and last position ``lo`` / ``hi``. Made by ``tile_rows``."""

    def __init__(self, row, head, pos, req, q: torch.Tensor, group: int, tile, slot, count: int, size: int) -> None:
        """``q`` [tokens x heads, d]: the queries by row id."""
        dev = row.device
        self.size, self.count, self.group = size, count, group
        self.row = torch.full((count, size), -1, dtype=torch.long, device=dev)
        self.head = torch.zeros((count, size), dtype=torch.long, device=dev)
        self.pos = torch.full((count, size), -1, dtype=torch.long, device=dev)
        self.row[tile, slot], self.head[tile, slot], self.pos[tile, slot] = row, head, pos
        self.req, self.kv_head = (torch.zeros(count, dtype=torch.long, device=dev) for _ in range(2))
        self.req[tile], self.kv_head[tile] = req, head // group
        self.lo, self.hi = self.pos[:, 0], self.pos.max(1).values
        self.q = q[self.row.clamp_min(0)]

    def group_heads(self, tile: torch.Tensor) -> torch.Tensor:
        """[len(tile), 1, group]: the query heads of each tile's kv head."""
        return (self.kv_head[tile] * self.group)[:, None, None] + torch.arange(self.group, device=tile.device)


def tile_rows(tok, head, req, pos, q: torch.Tensor, heads: int, kv_heads: int, q_tile: int) -> list[Tiles]:
    """Rows (token ``tok``, query ``head``) grouped by (request, kv head) in order of position, the query heads
    of a kv head together, cut into tiles of ``q_tile`` rows; what is left of a group (and a group shorter than
    a tile) goes into one tile of the smallest size q_tile / 4^i that holds it, so a head with few rows is not
    padded to a full tile. One ``Tiles`` per size. ``q`` [tokens x heads, d]: the queries by row id."""
    dev = tok.device
    group = heads // kv_heads
    r = req[tok]
    key, order = torch.sort(r * kv_heads + head // group, stable=True)  # stable: positions stay in order
    tok, head, r = tok[order], head[order], r[order]
    _, counts = torch.unique_consecutive(key, return_counts=True)
    n = key.numel()
    grp = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts, output_size=n)
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[grp]
    whole = counts // q_tile  # full tiles per group
    rest = counts - whole * q_tile
    rest_size = torch.full_like(counts, q_tile)
    s = q_tile
    while s > 1:  # the smallest q_tile / 4^i that holds the rest
        s = max(1, s // 4)
        rest_size = torch.where(rest <= s, s, rest_size)
    rest_size = torch.where(rest > 0, rest_size, 0)
    sizes = set(rest_size.unique().tolist()) - {0} | ({q_tile} if bool(whole.any()) else set())
    in_rest = rank >= whole[grp] * q_tile
    out = []
    for s in sorted(sizes, reverse=True):
        per = (rest_size == s).long() + (whole if s == q_tile else 0)  # tiles per group of this size
        mine = (rest_size[grp] == s) & in_rest
        if s == q_tile:
            mine |= ~in_rest
        g, k = grp[mine], rank[mine]
        tile = (torch.cumsum(per, 0) - per)[g] + torch.where(k >= whole[g] * q_tile, whole[g] if s == q_tile else 0,
                                                                k // q_tile)
        slot = torch.where(k >= whole[g] * q_tile, k - whole[g] * q_tile, k % q_tile)
        out.append(Tiles(tok[mine] * heads + head[mine], head[mine], pos[tok[mine]], r[mine], q, group, tile, slot,
                         int(per.sum()), s))
    return out


def candidates(tiles: Tiles, pred: Mask, kt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile, block index) of every key block (``kt`` positions) a tile may read under ``pred``, sorted by tile:
    at or before the tile's last position and not excluded by the predicate's ``tiles`` test for any query
    head of the tile's kv head."""
    lo, hi = tiles.lo, tiles.hi
    kl = torch.arange(int(hi.max()) // kt + 1, device=lo.device) * kt
    ok = kl[None] <= hi[:, None]
    test = pred.tiles
    if test is not None:
        zero = torch.zeros((), dtype=torch.long, device=lo.device)
        every = torch.arange(tiles.count, device=lo.device)
        hit = test(zero, tiles.group_heads(every), lo[:, None, None], hi[:, None, None], kl[None, :, None],
                   kl[None, :, None] + kt - 1)
        ok &= hit.expand(*ok.shape, tiles.group).any(-1)
    return ok.nonzero(as_tuple=True)


def _allowed(tiles: Tiles, tile, chunk, pred: Mask, kt: int) -> torch.Tensor:
    """bool [chunks, size, kt]: which (row, key) of each (tile, chunk) the predicate allows (and causality)."""
    i32 = torch.int32  # positions and heads as int32: half the memory traffic of int64 for every comparison
    kpos = (chunk.to(i32) * kt)[:, None, None] + torch.arange(kt, dtype=i32, device=tile.device)
    qpos = tiles.pos[tile].to(i32)[:, :, None]
    zero = torch.zeros((), dtype=i32, device=tile.device)
    return pred(zero, tiles.head[tile].to(i32)[:, :, None], qpos, kpos) & (kpos <= qpos)


def gather(view: torch.Tensor, base: torch.Tensor, workspace: Workspace,
           transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of the (block, kv head) tiles ``base`` (= block x kv_heads + kv head, any shape
    [...]): [..., block_size, d] each, contiguous (the keys transposed back from the cache's layout: one more
    copy), or with ``transposed`` the keys as the cache holds them, [..., d, block_size]."""
    bs, d = view.shape[3], view.shape[4]
    flat = view.reshape(-1, bs, d)  # rows: (block, kv head, keys | values)
    idx = base.flatten() * 2
    n = idx.numel()
    both = workspace.take("kv", (2 * n, bs, d), flat)
    torch.index_select(flat, 0, torch.cat([idx, idx + 1]), out=both)
    if transposed:
        return both[:n].view(*base.shape, d, bs), both[n:].view(*base.shape, bs, d)
    k = workspace.take("k", (n, bs, d), flat)
    k.copy_(both[:n].view(n, d, bs).transpose(1, 2))
    return k.view(*base.shape, bs, d), both[n:].view(*base.shape, bs, d)


def attend_part(tiles: Tiles, pred: Mask, view, block_table, scale: float, softcap: float, pack: int,
                workspace: Workspace):
    """The tiles against the keys of ``view`` that ``pred`` allows them: yields (tile [n], output [n, size, d],
    log-sum-exp [n, size] float32, -inf where a row reads none of those keys), a call's worth at a time."""
    kt = view.shape[3]  # a chunk is one block
    tile, chunk = candidates(tiles, pred, kt)
    if tile.numel() == 0:
        return
    per_mask = tiles.size * kt
    dense_test = pred.dense
    if dense_test is not None:
        zero = torch.zeros((), dtype=torch.long, device=tile.device)
        kl = chunk * kt
        lo, hi = tiles.lo[tile][:, None, None], tiles.hi[tile][:, None, None]
        dense = dense_test(zero, tiles.group_heads(tile), lo, hi, kl[:, None, None], kl[:, None, None] + kt - 1)
        dense = dense.expand(tile.numel(), 1, tiles.group).flatten(1).all(1) & (kl + kt - 1 <= tiles.lo[tile])
        kept = None
    else:  # the predicate on every candidate, in pieces; the masks of the partly allowed chunks are kept
        step = max(1, MAX_MASK_ELEMENTS // per_mask)
        pieces = [_allowed(tiles, tile[a:a + step], chunk[a:a + step], pred, kt) for a in range(0, tile.numel(), step)]
        dense = [p.flatten(1).all(1) for p in pieces]
        kept = torch.cat([p[~d] for p, d in zip(pieces, dense)])
        dense = torch.cat(dense)
    base = block_table[tiles.req[tile], chunk].long() * view.shape[1] + tiles.kv_head[tile]
    part = (~dense).nonzero().squeeze(1)
    per_block = 2 * kt * view.shape[4] * view.element_size()
    step = max(1, min(MAX_MASK_ELEMENTS // per_mask, MAX_GATHER_BYTES // per_block))
    for a in range(0, part.numel(), step):
        p = part[a:a + step]
        allowed = _allowed(tiles, tile[p], chunk[p], pred, kt) if kept is None else kept[a:a + step]
        k, v = gather(view, base[p], workspace)
        o, lse = attend(tiles.q.index_select(0, tile[p]), k, v, allowed, scale, softcap)
        yield tile[p], o, lse.masked_fill_(~allowed.any(-1), NEG_INF)
    for t, members in _packed(tile, dense, pack):
        s = members.shape[1]
        step = max(1, MAX_GATHER_BYTES // (2 * s * kt * view.shape[4] * view.element_size()))
        for a in range(0, t.numel(), step):
            m = members[a:a + step]
            k, v = (t.view(m.shape[0], s * kt, -1) for t in gather(view, base[m], workspace))
            yield t[a:a + step], *attend(tiles.q.index_select(0, t[a:a + step]), k, v, None, scale, softcap)


def _packed(tile: torch.Tensor, dense: torch.Tensor, pack: int):
    """The dense candidates of each tile in groups of ``pack`` chunks, then one group of each smaller power of
    two for the rest: yields (tile [groups], candidate indices [groups, group size]) per group size."""
    idx = dense.nonzero().squeeze(1)  # in tile order
    if idx.numel() == 0:
        return
    t = tile[idx]
    _, counts = torch.unique_consecutive(t, return_counts=True)
    n = torch.repeat_interleave(counts, counts, output_size=t.numel())
    rank = torch.arange(t.numel(), device=t.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts,
                                                                              output_size=t.numel())
    end = n // pack * pack
    size = torch.where(rank < end, pack, 0)
    s = pack // 2
    while s >= 1:
        has = (n - end) & s
        size = torch.where((has > 0) & (rank >= end) & (rank < end + s), s, size)
        end = end + has
        s //= 2
    for s in sorted(set(size.tolist()), reverse=True):
        members = idx[size == s].view(-1, s)
        yield tile[members[:, 0]], members


def attend(q, k, v, allowed, scale: float, softcap: float):
    """q [n, size, d] against k, v [n, keys, d] (``allowed`` [n, size, keys] or None: every key): (output
    [n, size, d], log-sum-exp [n, size] float32). torch's fused flash attention for the CPU where it applies;
    otherwise scores by matmul in float32, soft-capped if asked."""
    if softcap or not q.is_cpu or not FUSED:
        s = torch.bmm(q.float(), k.float().transpose(1, 2)) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if allowed is not None:
            s = s.masked_fill(~allowed, NEG_INF)
        p, lse = softmax_lse(s)
        return torch.bmm(p, v.float()).to(q.dtype), lse
    mask = None
    if allowed is not None:
        mask = torch.where(allowed, torch.zeros((), dtype=q.dtype, device=q.device),
                           torch.full((), NEG_INF, dtype=q.dtype, device=q.device))[:, None]
    o, lse = _flash(q[:, None], k[:, None], v[:, None], 0.0, False, attn_mask=mask, scale=scale)
    return o[:, 0], lse[:, 0].float()


class Merger:
    """``allhere.softmax.merge_pieces`` over pieces handed in one at a time (``add``), holding at most about
    ``budget`` bytes of them: past it, what is held is merged into one piece (each row's output so far and its
    log-sum-exp), so a prefill whose rows read many key blocks keeps one row-sized result, not an output per block
    it read."""

    def __init__(self, n_rows: int, d: int, device, budget: int | None = None) -> None:
        self.n_rows, self.d, self.device = n_rows, d, device
        self.budget = MERGE_BUDGET if budget is None else budget
        self.held, self.bytes = [], 0

    def add(self, piece) -> None:
        self.held.append(piece)
        self.bytes += sum(t.numel() * t.element_size() for t in piece)
        if self.bytes > self.budget and len(self.held) > 1:
            out, lse = merge_pieces(self.held, self.n_rows, self.d, self.device)
            rows = torch.arange(self.n_rows, device=self.device)[:, None]
            self.held, self.bytes = [(rows, out[:, None], lse[:, None])], 0  # the merged piece counts as free

    def result(self) -> torch.Tensor:
        """[n_rows, d] float32: every row's softmax over all it read (0 for a row that read nothing)."""
        return merge_pieces(self.held, self.n_rows, self.d, self.device)[0]
