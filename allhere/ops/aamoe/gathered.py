"""AA-MoE attention that reads only what was chosen, laid out by key block (as MoBA's and MoE's dispatch).

Every (query, resource) read is a *pair*: each chosen rank, and the own chunk when ``own_chunk`` (bias 0).
Pairs are sorted by the key block they read (context chunk j of batch row b, or expert e, shared by the
batch) and cut into tiles of ``TILE`` pairs of one block: a tile is one [TILE, d] x [d, m] product per
head against its block's m keys, so no key is copied per pair, and a block's key/value gradient is a sum
over its tiles. A query's pairs share one softmax: its row maximum, normaliser and output gather the
pairs through a [query, rank] grid. Every move is one gather along dimension 0 by an index built once per
call (``_Layout``), with no Python loop over chunks, ranks or experts. Forward and backward are written
out (``_AAMoE``, flash-attention style: the backward works from the saved probabilities). Work and
memory grow with sum_i (B_i + own chunk) x m plus the padding of the tiles, not with L x (L + E m).
Equal to ``reference`` in outputs and gradients (tests). The "torch" path of op family ``"aamoe"``."""

from __future__ import annotations

import functools

import torch

from ...softmax import NEG_INF, default_scale
from .common import check_aamoe

TILE = 16  # pairs per tile: one [TILE, d] x [d, m] product per head and tile
FLOOR = -80.0  # exp() of what lies further below the row maximum is taken at this floor (~1e-35, not 0):
#                 the same to fp32 precision, and CPU exp is many times slower on arguments that underflow


class _Layout:
    """Index tensors of one call.

    Pairs: grid slot k * rows + r for rank k of query row r = b * lq + i, rank 0 being the own chunk when it
    is read. Tile slots: the pairs sorted by key block, each block padded to whole tiles, then one spare
    tile of padding whose first slot stands for every empty grid slot (its scores are -inf: it adds 0 and
    never wins a maximum). Per-query tensors keep the op's layout [b, h, lq, c]; per-tile ones are
    [h * tiles, TILE, c] (head-major); ``*_h`` indices address them flattened to rows, over every head."""

    def __init__(self, choice: torch.Tensor, lk: int, chunk: int, n_chunks: int, experts: int, own: bool, h: int):
        dev = choice.device
        b, lq, _ = choice.shape
        rows, n_ctx, n_groups = b * lq, b * n_chunks, b * n_chunks + experts
        if own:  # the own chunk as rank 0
            choice = torch.cat([_own_chunks(lk, lq, chunk, dev).expand(b, lq, 1), choice], -1)
        k = choice.shape[-1]
        self.b, self.h, self.lq, self.k, self.groups = b, h, lq, k, n_groups
        grid = choice.permute(2, 0, 1).reshape(-1)
        is_mem = grid >= n_chunks
        # key block of every grid slot: chunk j of batch row r -> r * n_chunks + j, expert e -> n_ctx + e;
        # an unused rank -> n_groups (sorted last)
        group = torch.where(is_mem, grid + (n_ctx - n_chunks), grid + _row_offsets(k, b, lq, n_chunks, dev))
        group = group.masked_fill_(grid < 0, n_groups)
        g, slot = torch.sort(group, stable=True)
        counts = torch.bincount(group, minlength=n_groups + 1)[:n_groups]
        tiles = (counts + TILE - 1) // TILE
        n_pairs, self.n_tiles = (int(x) for x in torch.stack([counts.sum(), tiles.sum() + 1]))  # + a spare tile
        g, slot = g[:n_pairs], slot[:n_pairs]
        shift = torch.cumsum(tiles, 0).sub_(tiles).mul_(TILE).sub_(torch.cumsum(counts, 0).sub_(counts))
        pos = shift[g].add_(torch.arange(n_pairs, device=dev))  # tile slot of every pair
        n_pad, spare = self.n_tiles * TILE, (self.n_tiles - 1) * TILE
        tile_group = torch.repeat_interleave(torch.cat([tiles, tiles.new_ones(1)]), output_size=self.n_tiles)
        tile_group = tile_group.clamp_(max=n_groups - 1)  # the spare tile reads any block
        at = torch.full((n_pad,), k * rows, dtype=torch.long, device=dev).index_put_((pos,), slot)  # grid slot
        self.slot = at  # (k * rows: padding) -> the bias of every tile slot
        row = at % rows  # the query row of every tile slot
        qpos = torch.where(at < k * rows, row % lq + (lk - lq), -1).view(self.n_tiles, TILE, 1)
        key = (tile_group % n_chunks * chunk)[:, None] + torch.arange(chunk, device=dev)
        key = key.masked_fill_((tile_group >= n_ctx)[:, None], 0)
        self.ok = key[:, None, :] <= qpos  # [tiles, TILE, m]: a pair, and causal inside the context
        self.off = ~self.ok
        inv = torch.full((k * rows,), spare, dtype=torch.long, device=dev).index_put_((slot,), pos)  # grid -> tile
        # the same for the query gradient: a grid for q (context pairs), then one for q_mem (experts)
        inv_q = torch.full((2 * k * rows,), spare, dtype=torch.long, device=dev).index_put_(
            (slot + is_mem[slot].long() * (k * rows),), pos)
        self.inv = inv
        heads = torch.arange(h, device=dev)
        # tile slot (head, s) -> row (b, head, i) of a per-query tensor; of [q; q_mem] for the queries
        base = row + row.div(lq, rounding_mode="floor") * ((h - 1) * lq)  # (b, 0, i)
        self.row_h = (base[None] + heads[:, None] * lq).flatten()
        mem_row = torch.cat([is_mem, is_mem.new_zeros(1)])[at] * (b * h * lq)
        self.qrow_h = self.row_h + mem_row.repeat(h)
        self.group_h = (heads[:, None] * n_groups + tile_group).flatten()  # tile (head, t) -> key block row
        # grid (b, head, rank, i) -> tile slot (head, s); for the query gradient (kind, b, head, rank, i)
        heads = heads.view(h, 1, 1) * n_pad
        self.inv_h = (inv.view(k, b, lq).transpose(0, 1)[:, None] + heads).flatten()
        self.inv_q_h = (inv_q.view(2, k, b, lq).transpose(1, 2)[:, :, None] + heads).flatten()

    def to_tiles(self, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """Per query x [b, h, lq, c] -> per tile slot [h * tiles, TILE, c] (``index``: ``row_h`` or ``qrow_h``)."""
        c = x.shape[-1]
        return x.reshape(-1, c).index_select(0, self.row_h if index is None else index).view(-1, TILE, c)

    def row_sum(self, x: torch.Tensor, index: torch.Tensor | None = None, kinds: int = 1) -> torch.Tensor:
        """Per tile slot x [h * tiles, TILE, c] -> the sum over each query's pairs [kinds * b, h, lq, c]
        (``index``: ``inv_h``, or ``inv_q_h`` with kinds = 2)."""
        c = x.shape[-1]
        y = x.reshape(-1, c).index_select(0, self.inv_h if index is None else index)
        return y.view(kinds * self.b, self.h, self.k, self.lq, c).sum(2)

    def row_max(self, x: torch.Tensor) -> torch.Tensor:
        """Per tile slot x [h * tiles, TILE, 1] -> the maximum over each query's pairs [b, h, lq, 1]."""
        return x.reshape(-1, 1).index_select(0, self.inv_h).view(self.b, self.h, self.k, self.lq, 1).amax(2)

    def tiles(self, blocks: torch.Tensor) -> torch.Tensor:
        """Key blocks [h, groups, m, d] -> per tile [h * tiles, m, d]."""
        m, d = blocks.shape[2:]
        return blocks.view(-1, m * d).index_select(0, self.group_h).view(-1, m, d)

    def block_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per tile x [h * tiles, m, d] -> the sum over each key block's tiles [h, groups, m, d]."""
        m, d = x.shape[1:]
        out = x.new_zeros(self.h * self.groups, m * d).index_add_(0, self.group_h, x.view(-1, m * d))
        return out.view(self.h, self.groups, m, d)


@functools.lru_cache(maxsize=64)
def _own_chunks(lk: int, lq: int, chunk: int, device: torch.device) -> torch.Tensor:
    """[1, lq, 1] the chunk of each query (the last lq of lk positions)."""
    return ((lk - lq + torch.arange(lq, device=device)) // chunk).view(1, lq, 1)


@functools.lru_cache(maxsize=64)
def _row_offsets(k: int, b: int, lq: int, n_chunks: int, device: torch.device) -> torch.Tensor:
    """[k * b * lq] batch row x n_chunks of every grid slot (the first key block of its row)."""
    return (torch.arange(b, device=device) * n_chunks).repeat_interleave(lq).repeat(k)


def _blocks(ctx: torch.Tensor, mem: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """Context keys [b, kv_heads, lk, d] and expert slots [h, E, m, d] -> key blocks [h, b * n_chunks + E, m, d]
    (fp32; chunk j of batch row b is block b * n_chunks + j; the last chunk zero-padded)."""
    b, hkv, lk, d = ctx.shape
    h, experts, m, _ = mem.shape
    out = mem.new_empty(h, b * n_chunks + experts, m, d, dtype=torch.float32)
    dst = out[:, :b * n_chunks].view(h, b, n_chunks * m, d)
    dst[:, :, :lk].view(hkv, h // hkv, b, lk, d).copy_(ctx.transpose(0, 1)[:, None])  # head i reads kv i // g
    if n_chunks * m > lk:
        dst[:, :, lk:] = 0.0
    out[:, b * n_chunks:] = mem
    return out


def _unblocks(grad: torch.Tensor, b: int, hkv: int, lk: int, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``_blocks``: [h, groups, m, d] -> ([b, kv_heads, lk, d], [h, E, m, d])."""
    h, _, m, d = grad.shape
    ctx = grad[:, :b * n_chunks].reshape(h, b, n_chunks * m, d)[:, :, :lk]
    ctx = ctx.reshape(hkv, h // hkv, b, lk, d).sum(1) if hkv != h else ctx
    return ctx.transpose(0, 1), grad[:, b * n_chunks:]


class _AAMoE(torch.autograd.Function):
    @staticmethod
    def forward(q, q_mem, k, v, mem_k, mem_v, bias, lay: _Layout, n_chunks: int, scale: float):
        """q, q_mem [b, h, lq, d] (the context's queries and the memory's); k, v [b, kv_heads, lk, d];
        mem_k, mem_v [h, E, m, d]; bias [K * rows] log P per grid slot. Returns out [b, h, lq, d] (fp32)
        and, for the backward, the probabilities and the queries, keys (scaled) and values of the tiles."""
        d, nt, m = q.shape[-1], lay.n_tiles, mem_k.shape[2]
        qt = lay.to_tiles(torch.cat([q.reshape(-1, d).float(), q_mem.reshape(-1, d).float()]), lay.qrow_h)
        kt = lay.tiles(_blocks(k, mem_k, n_chunks)).mul_(scale)
        vt = lay.tiles(_blocks(v, mem_v, n_chunks))
        bias_t = torch.cat([bias.float(), bias.new_zeros(1, dtype=torch.float32)]).index_select(0, lay.slot)
        bias_t = torch.where(lay.ok, bias_t.view(nt, TILE, 1), NEG_INF)  # -inf: no pair, or a key after the query
        s = torch.bmm(qt, kt.transpose(1, 2)).view(-1, nt, TILE, m).add_(bias_t).view(-1, TILE, m)
        top = lay.row_max(s.amax(-1, keepdim=True)).nan_to_num_(neginf=0.0)  # [b, h, lq, 1]
        p = s.sub_(lay.to_tiles(top)).clamp_(min=FLOOR).exp_()
        p = p.view(-1, nt, TILE, m).masked_fill_(lay.off, 0.0).view(-1, TILE, m)
        den = lay.row_sum(p.sum(-1, keepdim=True)).clamp_(min=1.0)  # >= 1 (the maximum's term) unless no key
        p = p.div_(lay.to_tiles(den))
        return lay.row_sum(torch.bmm(p, vt)), p, qt, kt, vt

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, q_mem, k, v, mem_k, mem_v, _, lay, n_chunks, scale = inputs
        out, p, qt, kt, vt = output
        ctx.save_for_backward(out, p, qt, kt, vt)
        ctx.lay, ctx.n_chunks, ctx.scale = lay, n_chunks, scale
        ctx.shapes = (q.shape, k.shape, mem_k.shape)
        ctx.mark_non_differentiable(p, qt, kt, vt)
        ctx.set_materialize_grads(False)  # no zero gradients for the saved-only outputs

    @staticmethod
    def backward(ctx, d_out, *_):
        lay, n_chunks, scale = ctx.lay, ctx.n_chunks, ctx.scale
        (b, h, lq, d), (_, hkv, lk, _), _ = ctx.shapes
        out, p, qt, kt, vt = ctx.saved_tensors
        delta = (d_out * out).sum(-1, keepdim=True)  # [b, h, lq, 1]
        do_t = lay.to_tiles(d_out)
        ds = torch.bmm(do_t, vt.transpose(1, 2)).sub_(lay.to_tiles(delta)).mul_(p)
        dq = lay.row_sum(torch.bmm(ds, kt), lay.inv_q_h, kinds=2)  # [2 b, h, lq, d]: for q, then q_mem
        dk = lay.block_sum(torch.bmm(ds.transpose(1, 2), qt)).mul_(scale)
        dv = lay.block_sum(torch.bmm(p.transpose(1, 2), do_t))
        dbias = ds.view(h, -1, ds.shape[-1]).sum((0, 2))[lay.inv]
        (dk, dmk), (dv, dmv) = _unblocks(dk, b, hkv, lk, n_chunks), _unblocks(dv, b, hkv, lk, n_chunks)
        return dq[:b], dq[b:], dk, dv, dmk, dmv, dbias, None, None, None


def aamoe_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mem_k: torch.Tensor,
                          mem_v: torch.Tensor, choice: torch.Tensor, logp: torch.Tensor, chunk: int, own_chunk: bool,
                          scale: float | None = None, q_mem: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``aamoe_attention_reference``."""
    lq, lk, d, experts, n_chunks = check_aamoe(q, k, v, mem_k, mem_v, choice, logp, chunk)
    b, h = q.shape[:2]
    if not own_chunk and not choice.shape[-1]:
        return torch.zeros_like(q)  # nothing to read
    lay = _Layout(choice, lk, chunk, n_chunks, experts, own_chunk, h)
    bias = logp.permute(2, 0, 1).reshape(-1)  # rank-major, as the grid
    if own_chunk:  # rank 0: the own chunk, bias 0
        bias = torch.cat([bias.new_zeros(b * lq), bias])
    out, *_ = _AAMoE.apply(q, q if q_mem is None else q_mem, k, v, mem_k, mem_v, bias, lay, n_chunks,
                           default_scale(d, scale))
    return out.to(q.dtype)
