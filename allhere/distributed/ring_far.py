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

Transfers, deliberately simple: all transfers of a layer run in one autograd function (``_Exchange``) --
each rank sends every owner-to-reader message at once and waits; its backward sends the gradients of the
received payloads and K/V back to their owners in one go. Every rank runs the same layers in the same order,
so their exchanges meet in the same order forward and backward. No overlap of transfers with compute; what
arrived is not sent again in the backward, so it stays alive until then: the latents of every chunk read
far (up to n x d_down numbers on the last rank: it grows with n, not n / d, but at d_down per token) and the
full K/V spans read near.

Compute, block-wise. A unit is one key chunk of one round: its payload span expanded once (``expand``: DAR's
W_up and the host's K/V path, with autograd, so the gradients reach those weights and, through the exchange,
the latents' owner), then one block per query chunk of this rank that reads it, over the block's near keys
(full K/V) and far keys (the expansion): masked logits s, and the sums over its keys of exp(s - m) v and
exp(s - m), m the block's row maximum taken as a constant. Per query the blocks merge as out = sum_b
e^(m_b - M) o_b / sum_b e^(m_b - M) z_b, M the largest m_b: the softmax over every key it reads whatever the
constants, so forward and gradients are exact (the log-sum-exp merge of ``ring.py``, with each block's
normaliser carried unnormalised). A query that reads no key gets 0 / 1 = 0. Each unit runs under
``torch.utils.checkpoint`` (non-reentrant): autograd keeps its inputs -- q, the latent span and the near K/V
span, views of this rank's own tensors or of what arrived -- and recomputes the expansion, the masks (from
positions), the logits and the probabilities in the backward, one unit at a time. Kept per rank for the
backward, besides what arrived: q, this rank's K/V (as one [b, kv_heads, n/d, 2 dim] tensor) and latents (and
the block input W_down reads), the merged numerator (one fp32 tensor of the output's size) and, per block,
[b, h, chunk] merge weights -- measured 1.4x to 1.8x the bytes the plain ring keeps at 2 and 4 ranks
(``benchmarks/dar_ring_memory.py``: 1.5x to 1.7x at n = 4096), against 50x to 90x there when each query chunk
kept its fp32 scores and probabilities over every key it reads. The backward's peak adds one unit's
recomputation: its expansion and at most ``layouts.chunks_per_rank`` blocks of chunk x span scores. The price:
the backward computes the attention's forward (and the expansions) once more -- up to about 20% more time per
forward + backward of a one-layer model on CPU at n = 4096 -- and, without autograd, nothing is kept and
nothing recomputed.

Counters (``RingStats``): forward -- rounds with a block, rounds with a receive (``transfers``), bytes of
payload and K/V sent and received, 4 * rows * keys * dim attention FLOPs per (batch, head) of every kept
block (the expansion's matmuls are not counted); backward -- the bytes of the gradients sent back to
owners (the payloads and K/V are not sent again: autograd keeps what arrived), the same rounds, 10 *
rows * keys * dim FLOPs (the checkpoints' recomputation, 4 more, is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..ops.common import default_scale, repeat_kv
from ..softmax import NEG_INF, clamp_empty
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
    pos = [positions(fp.n, layout, world, fp.src(rank, t), q.device) for t in range(world)]
    units = []  # one per (round, key chunk) read: its spans, as views of what holds them, and its blocks
    for t in range(world):
        blocks = fp.blocks(rank, t)
        f_spans, n_spans = fp.needed(rank, t)
        spans = {}
        for kind, (sp, own, dim) in enumerate(((f_spans, payload, 1), (n_spans, kv, 2))):
            for (j, lo, hi), (at, _, _) in zip(sp, _offsets(sp).values()):
                x, at = (own, j * c + lo) if t == 0 else (received[t][kind], at)
                spans.setdefault(j, [None, None])[kind] = (x.narrow(dim, at, hi - lo), lo, hi,
                                                           pos[t][j * c + lo:j * c + hi])
        for j, (f_span, n_span) in spans.items():
            units.append(_Unit(n_span, f_span, [(blk.q_chunk, blk.near is not None, blk.far is not None)
                                                for blk in blocks if blk.k_chunk == j]))
    # the blocks' masks are not kept: each unit evaluates its own again from positions, forward and backward
    att = _Attend(far.expand, fp.reads, fp.near, scale, scores, pos[0], c, d)

    # per unit, under a checkpoint (kept for the backward: its inputs -- q, the spans' latents and K/V -- not
    # the expansion, the scores or the probabilities, which the backward recomputes): per block, the sums over
    # its keys of exp(s - m) v and exp(s - m), m the block's row maximum, a constant. Merged per query:
    # out = sum_b e^(m_b - M) o_b / sum_b e^(m_b - M) z_b, M the largest m_b -- the softmax over every key,
    # whatever the constants, so its gradient is the softmax's.
    ckpt = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, payload))
    per_chunk = [[] for _ in range(n_local // c)]
    for u in units:
        args = (u, q, *u.tensors())
        parts = checkpoint(att.block_sums, *args, use_reentrant=False) if ckpt else att.block_sums(*args)
        for (i, _, _), at in zip(u.blocks, range(0, len(parts), 3)):
            per_chunk[i].append(parts[at:at + 3])
    outs = []
    for i, parts in enumerate(per_chunk):
        if not parts:
            outs.append(q.narrow(2, i * c, c).float() * 0)  # still a function of q: the exchange's backward must run
            continue
        top = clamp_empty(torch.stack([m for _, _, m in parts]).amax(0))
        num = den = 0
        for o, z, m in parts:
            w = torch.exp(m - top)  # 0 where the block holds no key of the row
            num, den = num + o * w[..., None], den + z * w
        outs.append(num / torch.where(den > 0, den, 1.0)[..., None])  # a query that reads no key: 0 / 1
    out = torch.cat(outs, dim=2)

    flops = sum(4 * b * h * c * keys * d for u in units for keys in u.keys_per_block())
    if stats is not None:
        rounds = sum(1 for t in range(world) if fp.blocks(rank, t))
        stats.add("forward", rounds=rounds, flops=flops)
        if ckpt:
            stats.add("backward", rounds=rounds, flops=flops // 4 * 10)
    # with nothing to expand, expand nothing: the weights it uses then get zero gradients on this rank, as on
    # the others, rather than none (a gradient average over ranks needs the same parameters on every rank)
    if not any(u.far is not None for u in units):
        k_far, v_far = far.expand(payload.narrow(1, 0, 0), pos[0][:0])
        out = out + 0 * (k_far.sum() + v_far.sum())
    return out.to(q.dtype)


@dataclass
class _Unit:
    """The blocks of this rank's query chunks that read one key chunk of one round -- (query chunk, whether it
    reads some key near, whether far) -- and the spans of that chunk they read: (tensor [b, kv_heads, m, 2 dim]
    or [b, m, d_small], first, end, absolute positions [m])."""

    near: tuple | None
    far: tuple | None
    blocks: list[tuple[int, bool, bool]]

    def tensors(self) -> tuple:
        return tuple(None if s is None else s[0] for s in (self.near, self.far))

    def keys_per_block(self):
        for _, has_near, has_far in self.blocks:
            yield sum(s[2] - s[1] for s, used in ((self.near, has_near), (self.far, has_far)) if used)


class _Attend:
    """One unit's block arithmetic: the same in the forward and in the checkpoint's recomputation."""

    def __init__(self, expand, reads: Pattern, near: Pattern | None, scale: float, scores, q_pos: torch.Tensor,
                 c: int, d: int) -> None:
        self.expand, self.reads, self.near, self.scale, self.scores = expand, reads, near, scale, scores
        self.q_pos, self.c, self.d = q_pos, c, d

    def _allowed(self, qp: torch.Tensor, kp: torch.Tensor, kind: str) -> torch.Tensor:
        """bool [b|1, h|1, len(qp), len(kp)]: the keys read through the full K/V ("near") or the expansion."""
        reads = self.reads.mask(qp, kp)
        if self.near is None:
            return reads if kind == "far" else torch.zeros_like(reads)
        near = self.near.mask(qp, kp)
        return reads & near if kind == "near" else reads & ~near

    def logits(self, u: _Unit, q, near_kv, latents):
        """Per block of the unit: (query chunk, masked fp32 logits [b, h, c, keys], fp32 values [b, h, keys, dim]),
        the keys being the block's part of the near span (full K/V) then of the far span (the expanded latents)."""
        b, h, _, d = q.shape
        c = self.c
        parts = {}
        if near_kv is not None:
            kvf = near_kv.float()
            parts["near"] = (kvf[..., :d], kvf[..., d:], u.near)
        if latents is not None:
            kf, vf = self.expand(latents, u.far[3])
            parts["far"] = (kf.float(), vf.float(), u.far)  # near and far may differ in dtype
        for i, has_near, has_far in u.blocks:
            qp = self.q_pos[i * c:(i + 1) * c]
            keys, vals, allowed, kpos = [], [], [], []
            for kind, used in (("near", has_near), ("far", has_far)):
                if used:
                    kb, vb, (_, _, _, p) = parts[kind]
                    keys.append(kb)
                    vals.append(vb)
                    m = self._allowed(qp, p, kind)
                    allowed.append(m.expand(b, h, *m.shape[2:]))
                    kpos.append(p)
            cat = lambda xs, dim: xs[0] if len(xs) == 1 else torch.cat(xs, dim=dim)  # noqa: E731
            kr, vr = repeat_kv(cat(keys, 2), h), repeat_kv(cat(vals, 2), h)
            qi = q.narrow(2, i * c, c).float()
            if self.scores is None:
                s = (qi @ kr.transpose(-1, -2)) * self.scale
            else:
                s = self.scores(qi, kr, qp.view(1, 1, -1, 1), cat(kpos, 0).view(1, 1, 1, -1), self.scale).float()
            yield i, s.masked_fill(~cat(allowed, -1), NEG_INF), vr

    def block_sums(self, u: _Unit, q, near_kv, latents):
        """Per block of the unit, flat: (exp(s - m) @ v [b, h, c, dim], row sums of exp(s - m) [b, h, c], m), m the
        block's row maximum of the logits s without gradient (-inf where the row reads no key of the block, then
        the sums are 0), so no term exceeds 1."""
        out = []
        for _, s, vr in self.logits(u, q, near_kv, latents):
            m = s.detach().amax(-1)
            p = torch.exp(s - clamp_empty(m)[..., None])
            out += [p @ vr, p.sum(-1), m]
        return tuple(out)


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
        # the backward needs only the spans (not the plan, whose blocks hold their masks)
        ctx.needed = {(r, t): fp.needed(r, t) for t in range(1, world) for r in (fp.dst(rank, t), rank)}
        ctx.world, ctx.chunk, ctx.group, ctx.rank, ctx.stats = world, fp.chunk, group, rank, stats
        ctx.meta = [(payload.shape, payload.dtype), (kv.shape, kv.dtype)]
        return (q.view_as(q), *out)

    @staticmethod
    def backward(ctx, dq, *grads):
        needed, group, rank, stats = ctx.needed, ctx.group, ctx.rank, ctx.stats
        c, world = ctx.chunk, ctx.world
        base = 2 * world
        acc = [torch.zeros(shape, dtype=torch.float32, device=grads[0].device) for shape, _ in ctx.meta]
        sends, recvs = [], []
        for t in range(1, world):
            dst, src = (rank + t) % world, (rank - t) % world
            for kind, dim in enumerate((1, 2)):
                g = grads[2 * (t - 1) + kind]
                if needed[(rank, t)][kind]:  # the gradient of what we received, back to its owner
                    g = g.contiguous()
                    sends.append((dist.isend(g, _peer(group, src), group=group, tag=base + 2 * t + kind), g))
                    _count(stats, "backward", bytes_sent=g.nbytes)
                theirs = needed[(dst, t)][kind]
                if theirs:  # the gradient of what we sent, from its reader
                    shape = list(ctx.meta[kind][0])
                    shape[dim] = sum(hi - lo for _, lo, hi in theirs)
                    buf = torch.empty(shape, dtype=g.dtype, device=g.device)
                    recvs.append((dist.irecv(buf, _peer(group, dst), group=group, tag=base + 2 * t + kind), buf,
                                  kind, dim, theirs))
                    _count(stats, "backward", bytes_received=buf.nbytes)
            _count(stats, "backward", transfers=int(any(needed[(dst, t)])))
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
