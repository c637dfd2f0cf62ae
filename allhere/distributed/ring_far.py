"""Ring attention for keys read in a compact form (``ContextParallelPlan.far``, ``FarKV``): the distant keys
and values of a chunk are not sent but rebuilt by the rank that reads them from a small payload per token.

DAR ("Dual Dimensionality for Local and Global Attention", arXiv:2606.18587) reads key j from query i
through the host's full-dimensional K/V when i - j < w, and otherwise through K/V rebuilt from the
bottleneck h' = (h W_down) W_up. Here the payload is the latent c = h W_down (d_down numbers per token) and
``expand`` is W_up followed by the host's K/V path at the chunk's own absolute positions; a chunk's full
K/V (2 x kv_heads x head_dim numbers per token) travel only to a rank where some query has that chunk
within its window.

Round t: rank r reads the chunks of rank (r - t) mod d (round 0: its own), as in ``ring.py``. For every
(query chunk, key chunk) block the predicates decide, from absolute positions alone, whether any query
reads some key of it through ``near`` (the full K/V must travel) and whether any reads some key through
the payload (the payload must travel); a block with neither is skipped with its transfers. Of a chunk,
only the span from the first to the last key read that way travels: for DAR's window w <= chunk, the
latents of every earlier chunk read and the full K/V of the last w - 1 tokens of the neighbouring chunk.
Also, every rank meets in every exchange, and with nothing to expand it expands an empty payload: the
weights of ``expand`` get a (zero) gradient on every rank, as a gradient average over ranks needs.

Deliberately simple: all transfers of a layer run in one autograd function (``_Exchange``) -- each rank
sends every owner-to-reader message at once and waits; its backward sends the gradients of the received
payloads and K/V back to their owners in one go. Every rank runs the same layers in the same order, so
their exchanges meet in the same order forward and backward. The receiving rank then expands the
payloads (once, all chunks together, with autograd: the gradients reach W_up and the host's K/V weights
there and the latents' owner through the exchange) and, per query chunk, computes one softmax over every
key it reads (near blocks from the full K/V, far blocks from the expansion) under autograd. Exact, forward
and backward; the price of the simplicity: no overlap of transfers with compute, and per rank the expanded
K/V of every chunk it reads plus, per query chunk, its fp32 scores and probabilities over every key it reads
(chunk x keys, not one block at a time as ``ring.py``), kept for the backward -- a reference-grade ring
for tests and moderate lengths, not a tiled kernel.

Counters (``RingStats``): forward -- rounds with a block, rounds with a receive (``transfers``), bytes of
payload and K/V sent and received, 4 * rows * keys * dim attention FLOPs per (batch, head) of every kept
block (the expansion's matmuls are not counted); backward -- the bytes of the gradients sent back to
owners (the payloads and K/V are not sent again: autograd keeps what arrived), the same rounds, 10 *
rows * keys * dim FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ops.common import default_scale, repeat_kv
from .layouts import chunk_len, positions, rank_chunks
from .ring import RingStats
from .ring_blocks import Pattern, pattern_from


@dataclass(frozen=True)
class FarBlock:
    q_chunk: int  # index of the query chunk in the reading rank's shard
    k_chunk: int  # index of the key chunk in the source rank's shard
    near: torch.Tensor | None  # bool [b|1, h|1, c, c]: keys read through the full K/V; None: none
    far: torch.Tensor | None  # bool [b|1, h|1, c, c]: keys read through the expanded payload; None: none


Span = tuple[int, int, int]  # (key chunk, first, end): tokens [first, end) of that chunk, chunk-local


@dataclass
class FarPlan:
    """Which blocks each rank computes in each round and which tokens travel, from positions alone (every
    rank works out the same plan for every rank it talks to). Of a key chunk, only the span from the first
    to the last key some query of the reader reads that way travels (for a window: the chunk's last w - 1
    tokens as full K/V; for a predicate with holes, the holes inside the span too)."""

    reads: Pattern
    near: Pattern | None
    n: int
    world: int
    layout: str
    device: torch.device | None = None
    me: int | None = None  # the rank this plan runs on: only its own blocks keep their masks
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.chunk = chunk_len(self.n, self.layout, self.world)

    def src(self, rank: int, t: int) -> int:
        return (rank - t) % self.world

    def dst(self, rank: int, t: int) -> int:
        return (rank + t) % self.world

    def blocks(self, rank: int, t: int) -> list[FarBlock]:
        """The blocks rank ``rank`` computes in round t, with their masks (only for the plan's own rank,
        ``me``, or every rank when it is None)."""
        blocks = self._get(rank, t)[0]
        if blocks is None:
            raise ValueError(f"this plan keeps the blocks of rank {self.me} only, not of rank {rank}")
        return blocks

    def needed(self, rank: int, t: int) -> tuple[list[Span], list[Span]]:
        """(spans whose payload, spans whose full K/V) rank ``rank`` reads in round t, chunk indices in the
        source's shard, in shard order."""
        return self._get(rank, t)[1]

    def _get(self, rank: int, t: int):
        key = (rank, t)
        if key not in self._memo:
            blocks = self._decide(rank, t)
            spans = _spans(blocks, "far"), _spans(blocks, "near")
            self._memo[key] = (blocks if self.me in (None, rank) else None), spans
        return self._memo[key]

    def _decide(self, r: int, t: int) -> list[FarBlock]:
        c = self.chunk
        theirs = rank_chunks(self.layout, self.world, self.src(r, t))
        out = []
        for i, cq in enumerate(rank_chunks(self.layout, self.world, r)):
            qp = torch.arange(cq * c, (cq + 1) * c, device=self.device)
            for j, ck in enumerate(theirs):
                if not self.reads.block_kept(cq * c, (cq + 1) * c, ck * c, (ck + 1) * c):
                    continue
                kp = torch.arange(ck * c, (ck + 1) * c, device=self.device)
                reads = self.reads.mask(qp, kp)
                near = reads & self.near.mask(qp, kp) if self.near is not None else torch.zeros_like(reads)
                far = reads & ~near
                near, far = (m if bool(m.any()) else None for m in (near, far))
                if near is not None or far is not None:
                    out.append(FarBlock(i, j, near, far))
        return out


def _spans(blocks: list[FarBlock], kind: str) -> list[Span]:
    cols: dict[int, torch.Tensor] = {}
    for blk in blocks:
        m = getattr(blk, kind)
        if m is not None:
            hit = m.flatten(0, 2).any(0)
            cols[blk.k_chunk] = hit | cols[blk.k_chunk] if blk.k_chunk in cols else hit
    out = []
    for j in sorted(cols):
        idx = cols[j].nonzero().flatten()
        out.append((j, int(idx[0]), int(idx[-1]) + 1))
    return out


def _offsets(spans: list[Span]) -> dict[int, tuple[int, int, int]]:
    """key chunk -> (offset in the message, first, end)."""
    out, at = {}, 0
    for j, lo, hi in spans:
        out[j] = (at, lo, hi)
        at += hi - lo
    return out


def ring_far_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, *, group=None,
                       layout: str = "contiguous", scale: float | None = None, stats: RingStats | None = None,
                       scores=None) -> torch.Tensor:
    """Attention of this rank's query shard over the whole sequence, under a ``ContextParallelPlan`` with a
    ``far`` part (``allhere.mechanisms.base.FarKV``): query i reads key j where ``plan.reads`` holds, through
    the host's k, v where ``plan.far.near`` also holds, through ``plan.far.expand`` of j's payload otherwise;
    one softmax over all of them.

    q [b, h, n/d, dim], k, v [b, kv_heads, n/d, dim], ``plan.far.payload`` [b, n/d, d_small]: this rank's
    shard (``layouts.shard``) of a sequence of n tokens split over the d ranks of ``group`` (default: the
    world). Returns [b, h, n/d, dim] in q's dtype; a query that reads no key gets zeros. Differentiable in
    q, k, v, the payload and whatever ``expand`` uses. ``scores``: the block's logits as a function of q and
    k (``ContextParallelPlan.scores``); None: (q @ k^T) * scale. A gate is not supported here."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring attention needs an initialised torch.distributed process group")
    if plan.gate is not None:
        raise NotImplementedError("ring_far_attention: a gate together with compact (far) keys is not supported")
    far = plan.far
    b, h, n_local, d = q.shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pat = lambda p: pattern_from(p, batch=b, heads=h)  # noqa: E731
    fp = FarPlan(pat(plan.reads), None if far.near is None else pat(far.near), n_local * world, world, layout,
                 q.device, rank)
    c, scale = fp.chunk, default_scale(d, scale)
    payload = far.payload
    if payload.dim() != 3 or payload.shape[:2] != (b, n_local):
        raise ValueError(f"FarKV.payload must be [batch, n / world, d_small] = [{b}, {n_local}, ...], "
                         f"got {tuple(payload.shape)}")
    kv = torch.cat([k, v], dim=-1)
    q, received = _exchange(fp, group, rank, stats, q, payload, kv)  # {t: (payload message, K/V message)}
    # (round, key chunk) -> (tensor, offset of the span in it, first, end): where each span's tokens are
    far_src, near_src = {}, {}
    for t in range(world):
        f_spans, n_spans = fp.needed(rank, t)
        for (j, lo, hi), (at, _, _) in zip(f_spans, _offsets(f_spans).values()):
            far_src[(t, j)] = (payload, j * c + lo, lo, hi) if t == 0 else (received[t][0], at, lo, hi)
        for (j, lo, hi), (at, _, _) in zip(n_spans, _offsets(n_spans).values()):
            near_src[(t, j)] = (kv, j * c + lo, lo, hi) if t == 0 else (received[t][1], at, lo, hi)
    pos = [positions(fp.n, layout, world, fp.src(rank, t), q.device) for t in range(world)]
    q_pos = pos[0]

    # every payload span this rank reads, expanded at once at its own positions
    far_at, pieces, piece_pos, total = {}, [], [], 0
    for (t, j), (x, at, lo, hi) in far_src.items():
        far_at[(t, j)] = (total, lo, hi)
        pieces.append(x.narrow(1, at, hi - lo))
        piece_pos.append(pos[t][j * c + lo:j * c + hi])
        total += hi - lo
    # with nothing to expand, expand nothing: the weights it uses then get zero gradients on this rank, as on
    # the others, rather than none (a gradient average over ranks needs the same parameters on every rank)
    empty = not pieces
    if empty:
        pieces, piece_pos = [payload.narrow(1, 0, 0)], [q_pos[:0]]
    k_far, v_far = far.expand(torch.cat(pieces, dim=1), torch.cat(piece_pos))

    qf = q.float()
    outs, flops = [], 0
    for i in range(n_local // c):
        keys, vals, allowed, kpos = [], [], [], []
        for t in range(world):
            for blk in fp.blocks(rank, t):
                if blk.q_chunk != i:
                    continue
                if blk.near is not None:
                    x, at, lo, hi = near_src[(t, blk.k_chunk)]
                    kvb = x.narrow(2, at, hi - lo)
                    keys.append(kvb[..., :d])
                    vals.append(kvb[..., d:])
                    allowed.append(blk.near[..., lo:hi])
                    kpos.append(pos[t][blk.k_chunk * c + lo:blk.k_chunk * c + hi])
                if blk.far is not None:
                    at, lo, hi = far_at[(t, blk.k_chunk)]
                    keys.append(k_far.narrow(2, at, hi - lo))
                    vals.append(v_far.narrow(2, at, hi - lo))
                    allowed.append(blk.far[..., lo:hi])
                    kpos.append(pos[t][blk.k_chunk * c + lo:blk.k_chunk * c + hi])
        qi = qf.narrow(2, i * c, c)
        if not keys:
            outs.append(qi * 0)  # still a function of q: the exchange's backward must run
            continue
        kr = repeat_kv(torch.cat([x.float() for x in keys], dim=2), h)  # near and far may differ in dtype
        vr = repeat_kv(torch.cat([x.float() for x in vals], dim=2), h)
        mask = torch.cat([m.expand(b, h, c, m.shape[-1]) for m in allowed], dim=-1)
        if scores is None:
            s = (qi @ kr.transpose(-1, -2)) * scale
        else:
            s = scores(qi, kr, q_pos[i * c:(i + 1) * c].view(1, 1, -1, 1), torch.cat(kpos).view(1, 1, 1, -1),
                       scale).float()
        s = s.masked_fill(~mask, float("-inf"))
        seen = mask.any(-1, keepdim=True)
        p = torch.where(seen, torch.softmax(s.masked_fill(~seen, 0.0), dim=-1), 0.0)
        outs.append(p @ vr)
        flops += 4 * b * h * c * kr.shape[2] * d
    if stats is not None:
        rounds = sum(1 for t in range(world) if fp.blocks(rank, t))
        stats.add("forward", rounds=rounds, flops=flops)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, payload)):
            stats.add("backward", rounds=rounds, flops=flops // 4 * 10)
    out = torch.cat(outs, dim=2)
    if empty:
        out = out + 0 * (k_far.sum() + v_far.sum())
    return out.to(q.dtype)


# -- the transfers --------------------------------------------------------------------------------------------


def _exchange(fp: FarPlan, group, rank: int, stats, q, payload, kv):
    """(q, {round t: (payload message, K/V message)}). q passes through the exchange unchanged, so that its
    backward runs on every rank (also where nothing received is read), and the ranks meet in it."""
    if fp.world == 1:
        return q, {}
    q, *flat = _Exchange.apply(fp, group, rank, stats, q, payload, kv)
    return q, {t: (flat[2 * (t - 1)], flat[2 * (t - 1) + 1]) for t in range(1, fp.world)}


def _peer(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _pieces(x: torch.Tensor, spans: list[Span], c: int, dim: int) -> torch.Tensor:
    return torch.cat([x.narrow(dim, j * c + lo, hi - lo) for j, lo, hi in spans], dim=dim).contiguous()


class _Exchange(torch.autograd.Function):
    """Forward: every rank sends, for each round t, the payload and K/V spans rank (r + t) reads from it and
    receives those it reads from rank (r - t); returns q unchanged and the received messages (payloads
    [b, m, d_small], K/V [b, kv_heads, m, 2 dim]) of rounds 1..d-1, flat. Backward: the gradients of the
    received messages go back to their owners and are added to the gradients of the tokens that were sent."""

    @staticmethod
    def forward(ctx, fp, group, rank, stats, q, payload, kv):
        world = fp.world
        sends, recvs, out = [], [], []
        for t in range(1, world):
            dst, src = fp.dst(rank, t), fp.src(rank, t)
            for kind, (x, dim) in enumerate(((payload, 1), (kv, 2))):
                theirs = fp.needed(dst, t)[kind]
                if theirs:
                    msg = _pieces(x.detach(), theirs, fp.chunk, dim)
                    sends.append((dist.isend(msg, _peer(group, dst), group=group, tag=2 * t + kind), msg))
                    _count(stats, "forward", bytes_sent=msg.nbytes)
                ours = fp.needed(rank, t)[kind]
                shape = list(x.shape)
                shape[dim] = sum(hi - lo for _, lo, hi in ours)
                buf = torch.empty(shape, dtype=x.dtype, device=x.device)
                if ours:
                    recvs.append(dist.irecv(buf, _peer(group, src), group=group, tag=2 * t + kind))
                    _count(stats, "forward", bytes_received=buf.nbytes)
                out.append(buf)
            _count(stats, "forward", transfers=int(any(fp.needed(rank, t))))
        for w in recvs + [s for s, _ in sends]:
            w.wait()
        ctx.fp, ctx.group, ctx.rank, ctx.stats = fp, group, rank, stats
        ctx.meta = [(payload.shape, payload.dtype), (kv.shape, kv.dtype)]
        return (q.view_as(q), *out)

    @staticmethod
    def backward(ctx, dq, *grads):
        fp, group, rank, stats = ctx.fp, ctx.group, ctx.rank, ctx.stats
        c, world = fp.chunk, fp.world
        base = 2 * world
        acc = [torch.zeros(shape, dtype=torch.float32, device=grads[0].device) for shape, _ in ctx.meta]
        sends, recvs = [], []
        for t in range(1, world):
            dst, src = fp.dst(rank, t), fp.src(rank, t)
            for kind, dim in enumerate((1, 2)):
                g = grads[2 * (t - 1) + kind]
                if fp.needed(rank, t)[kind]:  # the gradient of what we received, back to its owner
                    g = g.contiguous()
                    sends.append((dist.isend(g, _peer(group, src), group=group, tag=base + 2 * t + kind), g))
                    _count(stats, "backward", bytes_sent=g.nbytes)
                theirs = fp.needed(dst, t)[kind]
                if theirs:  # the gradient of what we sent, from its reader
                    shape = list(ctx.meta[kind][0])
                    shape[dim] = sum(hi - lo for _, lo, hi in theirs)
                    buf = torch.empty(shape, dtype=g.dtype, device=g.device)
                    recvs.append((dist.irecv(buf, _peer(group, dst), group=group, tag=base + 2 * t + kind), buf,
                                  kind, dim, theirs))
                    _count(stats, "backward", bytes_received=buf.nbytes)
            _count(stats, "backward", transfers=int(any(fp.needed(dst, t))))
        for w, buf, kind, dim, theirs in recvs:
            w.wait()
            for j, (at, lo, hi) in _offsets(theirs).items():
                acc[kind].narrow(dim, j * c + lo, hi - lo).add_(buf.narrow(dim, at, hi - lo).float())
        for w, _ in sends:
            w.wait()
        return None, None, None, None, dq, acc[0].to(ctx.meta[0][1]), acc[1].to(ctx.meta[1][1])


def _count(stats, phase, **values):
    if stats is not None:
        stats.add(phase, **values)
