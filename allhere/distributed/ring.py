"""Ring attention (context parallelism): one sequence split across the ranks of a process group, after
"Ring Attention with Blockwise Transformers for Near-Infinite Context" (Liu, Zaharia, Abbeel,
arXiv:2310.01889).

Each rank keeps its query shard (``layouts``: contiguous or zigzag). In round t it attends to the
key/value chunks of rank (r - t) mod d, received point to point (``dist.isend`` / ``dist.irecv``) while
the previous round computes; the partial results (output, log-sum-exp) are merged by log-sum-exp, so the
result is exact. The backward pass (a custom autograd function) receives the key/value chunks again,
computes dQ locally and sends each dK/dV back to the chunk's owner. Saved for the backward: this rank's
q, k, v, output and log-sum-exp -- 1/d of the single-process activations.

Pattern-aware: ``ring_plan.py`` decides from the mask predicate and the absolute positions which blocks hold
any kept score; rounds nobody reads are skipped with their transfers, and only the chunks a rank reads
travel. Sliding-window attention with w <= n/d reads one neighbouring block; AHA's local (token, head)
pairs read only their window, and only chunks with global rows read the far blocks -- computing only
those rows, gathered per (batch, head).

A gate (``ring_gated_attention``: AHA's, per (token, head), between the causal prefix and the window):
the forward pass uses the hard gate exactly; a straight-through gate (``allhere.ops.ste``) gets dL/dgate
= sum dL/dout (a_wide - a_narrow), the single-process op's gradient. That needs both outputs of *every*
row, so while the gate is trained two more ring passes run without autograd, exactly as the
single-process op computes its a_full without autograd.

A block's logits are (q @ k^T) * scale, or any differentiable function ``scores(q, k, q_pos, k_pos,
scale)`` of the block (``allhere.mechanisms.base.ContextParallelPlan.scores``): the backward pass then
recomputes the block's logits under autograd and takes their gradient from the flash-attention dS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..masks import MaskFn
from ..ops.common import default_scale, hard_gate, repeat_kv
from ..ops.ste import add_gate_gradient, trains_gate
from ..softmax import NEG_INF, clamp_empty, merge_pair, softmax_lse
from .layouts import chunks_per_rank, positions
from .ring_blocks import Pattern, causal, pattern_from, sliding
from .ring_plan import Block, RingPlan, RingSpec, make_plan


@dataclass
class RingStats:
    """Counters of what a ring actually did on this rank, per phase ("forward", "backward")."""

    counts: dict = field(default_factory=lambda: {p: dict(rounds=0, transfers=0, bytes_sent=0, bytes_received=0,
                                                        flops=0) for p in ("forward", "backward")})

    def add(self, phase: str, **values) -> None:
        for k, v in values.items():
            self.counts[phase][k] += int(v)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern | MaskFn | None = None, *,
                   group=None, layout: str = "contiguous", scale: float | None = None,
                   stats: RingStats | None = None, scores=None) -> torch.Tensor:
    """Attention of this rank's query shard over the whole sequence under ``pattern`` (a ``Pattern``, or
    any ``allhere.masks`` predicate on absolute positions, evaluated for every batch row and head;
    default causal).

    q [b, h, n/d, dim], k, v [b, kv_heads, n/d, dim]: this rank's shard (``layouts.shard``) of a sequence
    of n tokens split over the d ranks of ``group`` (default: the world). Returns [b, h, n/d, dim] in
    q's dtype; a query that sees no key gets zeros. Differentiable in q, k and v. ``scores``: the block's
    logits as a function of q and k (see the module docstring); None: (q @ k^T) * scale."""
    spec = RingSpec(causal() if pattern is None else pattern_from(pattern, batch=q.shape[0], heads=q.shape[1]))
    return _run(q, k, v, None, spec, group, layout, scale, stats, scores)


def ring_gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
                         wide: Pattern | MaskFn, narrow: Pattern | MaskFn, *, group=None, layout: str = "contiguous",
                         scale: float | None = None, stats: RingStats | None = None, scores=None) -> torch.Tensor:
    """Attention of this rank's shard under ``wide`` where ``gate`` [b, h, n/d] is 1 and ``narrow`` (a subset
    of ``wide``) where it is 0: a bool gate, or a 0/1 float gate; a straight-through gate gets dL/dgate =
    sum dL/dout (a_wide - a_narrow), as ``allhere.ops.aha.aha_attention`` gives its gate."""
    pat = lambda p: pattern_from(p, batch=q.shape[0], heads=q.shape[1])  # noqa: E731
    wide, narrow = pat(wide), pat(narrow)
    out = _run(q, k, v, hard_gate(gate), RingSpec(wide, narrow), group, layout, scale, stats, scores)
    if trains_gate(gate):
        with torch.no_grad():
            a_wide = _run(q, k, v, None, RingSpec(wide), group, layout, scale, stats, scores)
            a_narrow = _run(q, k, v, None, RingSpec(narrow), group, layout, scale, stats, scores)
        out = add_gate_gradient(out, gate, a_wide, a_narrow)
    return out


def ring_aha_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int, *,
                       group=None, layout: str = "contiguous", scale: float | None = None,
                       stats: RingStats | None = None) -> torch.Tensor:
    """All-or-Here attention (AHA paper Eq. 4) of this rank's shard: full causal where ``gate`` [b, h,
    n/d] is 1, the ``window`` most recent keys where it is 0 -- the contract of
    ``allhere.ops.aha.aha_attention`` (``ring_gated_attention`` with the causal and window patterns)."""
    return ring_gated_attention(q, k, v, gate, causal(), sliding(window), group=group, layout=layout, scale=scale,
                                stats=stats)


def ring_plan(spec: RingSpec, shard_len: int, group, layout: str, sel: torch.Tensor | None = None) -> RingPlan:
    """The plan every rank of ``group`` agrees on: from positions alone, plus (with a selector) one
    all-gather of the selected-row counts per query chunk."""
    world = dist.get_world_size(group)
    wide_rows = None
    if sel is not None:
        cpr = chunks_per_rank(layout)
        b, h, n_local = sel.shape
        # on the selector's device: an NCCL-only group takes CUDA tensors alone
        mine = sel.reshape(b, h, cpr, n_local // cpr).sum(-1).amax(dim=(0, 1)).to(torch.int64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        wide_rows = [t.tolist() for t in every]
    return make_plan(spec, shard_len * world, world, layout, wide_rows)


def _run(q, k, v, sel, spec, group, layout, scale, stats, scores=None):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring attention needs an initialised torch.distributed process group")
    plan = ring_plan(spec, q.shape[2], group, layout, sel)
    ring = _Ring(plan, group, default_scale(q.shape[-1], scale), stats, scores)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _RingFunction.apply(q, k, v, sel, ring)
    return ring.forward(q, k, v, sel)[0].to(q.dtype)


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sel, ring):
        out, lse = ring.forward(q, k, v, sel)
        out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse, sel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sel = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(q, k, v, out, lse, sel, dout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class _Ring:
    """One ring pass of one rank: the plan, the process group, the transfers and the block arithmetic."""

    def __init__(self, plan: RingPlan, group, scale: float, stats: RingStats | None, scores=None) -> None:
        self.plan, self.group, self.scale, self.stats, self.scores = plan, group, scale, stats, scores
        self.rank, self.world = dist.get_rank(group), plan.world
        self.c = plan.chunk

    # -- communication ---------------------------------------------------------------------------------
    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _count(self, phase, **values):
        if self.stats is not None:
            self.stats.add(phase, **values)

    def _exchange(self, t: int, local: torch.Tensor, phase: str, tag: int):
        """Post round t's transfers: send our chunks that rank (r + t) reads, receive the chunks of rank
        (r - t) that we read. Returns (receive work or None, buffer or None, send works)."""
        sends, work, buf = [], None, None
        if not 0 < t < self.world:
            return work, buf, sends
        dst = self.plan.dst(self.rank, t)
        theirs = self.plan.needed(dst, t)
        if theirs:
            payload = torch.cat([self._chunk(local, j) for j in theirs], dim=2).contiguous()
            sends.append((dist.isend(payload, self._peer(dst), group=self.group, tag=tag), payload))
            self._count(phase, bytes_sent=payload.nbytes)
        ours = self.plan.needed(self.rank, t)
        if ours:
            shape = (*local.shape[:2], len(ours) * self.c, local.shape[3])
            buf = torch.empty(shape, dtype=local.dtype, device=local.device)
            work = dist.irecv(buf, self._peer(self.plan.src(self.rank, t)), group=self.group, tag=tag)
            self._count(phase, bytes_received=buf.nbytes, transfers=1)
        return work, buf, sends

    def _chunk(self, x: torch.Tensor, j: int) -> torch.Tensor:
        return x.narrow(min(2, x.dim() - 1), j * self.c, self.c)  # positions are 1-D

    # -- masks -----------------------------------------------------------------------------------------
    def _rows(self, sel: torch.Tensor, block: Block, rank_rows: int):
        """(row index [b, h, m], valid [b, h, m]) of the selected rows of the block's query chunk."""
        s = self._chunk(sel, block.q_chunk)
        idx = torch.argsort((~s).to(torch.int8), dim=-1, stable=True)[..., :rank_rows]
        valid = torch.arange(rank_rows, device=s.device) < s.sum(-1, keepdim=True)
        return idx, valid

    def _mask(self, block: Block, t: int, sel, rows):
        spec, c = self.plan.spec, self.c
        q_pos = self._chunk(self.q_pos, block.q_chunk)
        k_pos = self._chunk(self.k_pos[t], block.k_chunk)
        wide = spec.wide.mask(q_pos, k_pos)  # [b|1, h|1, c, c]
        if spec.narrow is None:
            return wide
        if rows is None:
            narrow = spec.narrow.mask(q_pos, k_pos)
            return torch.where(self._chunk(sel, block.q_chunk)[..., None], wide, narrow)
        idx, valid = rows
        b, h, m = idx.shape
        wide = wide.expand(b, h, c, c).gather(2, idx[..., None].expand(b, h, m, c))
        return wide & valid[..., None]

    def _setup(self, q, sel):
        n, layout = self.plan.n, self.plan.layout
        self.q_pos = positions(n, layout, self.world, self.rank, q.device)
        self.k_pos = [positions(n, layout, self.world, self.plan.src(self.rank, t), q.device)
                      for t in range(self.world)]

    def _gathered(self, sel, block):
        if block.rows == "all":
            return None
        return self._rows(sel, block, self.plan.rows(self.rank, block))

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, q, k, v, sel):
        self._setup(q, sel)
        b, h, n_local, d = q.shape
        qf = q.float()
        kv = torch.cat([k, v], dim=-1)
        acc = torch.zeros(b, h, n_local, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, n_local), NEG_INF, dtype=torch.float32, device=q.device)
        sends = []
        pending = self._exchange(1, kv, "forward", tag=1)  # round 1 travels while round 0 computes
        for t in range(self.world):
            if t == 0:
                block_kv, index = kv, None
            else:
                work, buf, s = pending
                sends += s
                if work is not None:
                    work.wait()
                block_kv, index = buf, self.plan.needed(self.rank, t)
                pending = self._exchange(t + 1, kv, "forward", tag=t + 1)  # overlaps this round's compute
            blocks = self.plan.blocks(self.rank, t)
            if blocks:
                self._count("forward", rounds=1)
            for blk in blocks:
                _, kb, vb, rows, mask, logits = self._block_inputs(blk, t, block_kv, index, sel, d)
                qb = self._chunk(qf, blk.q_chunk)
                if rows is not None:
                    qb = qb.gather(2, rows[0][..., None].expand(-1, -1, -1, d))
                o_p, l_p = _attend(qb, kb, vb, mask, self.scale, logits)
                self._count("forward", flops=4 * b * h * qb.shape[2] * kb.shape[2] * d)
                self._merge(acc, lse, blk, rows, o_p, l_p)
        for w, _ in sends + pending[2]:
            w.wait()
        return acc, lse

    def _block_inputs(self, blk, t: int, block_kv, index, sel, d: int):
        """The position j of a block's key chunk in this round's buffer (``index`` lists the chunks it holds,
        None for our own), that chunk's K and V, the block's gathered query rows, its mask and its logits
        function (q, k -> scores; None: q k^T * scale): the same in the forward and the backward."""
        j = blk.k_chunk if index is None else index.index(blk.k_chunk)
        kb, vb = self._chunk(block_kv, j).float().split(d, dim=-1)
        rows = self._gathered(sel, blk)
        logits = None
        if self.scores is not None:  # the block's absolute positions, for the mechanism's own logits
            q_pos = self._chunk(self.q_pos, blk.q_chunk)
            q_pos = q_pos.view(1, 1, -1, 1) if rows is None else q_pos[rows[0]][..., None]
            k_pos = self._chunk(self.k_pos[t], blk.k_chunk).view(1, 1, 1, -1)
            logits = lambda qb, kb: self.scores(qb, kb, q_pos, k_pos, self.scale)  # noqa: E731
        return j, kb, vb, rows, self._mask(blk, t, sel, rows), logits

    def _merge(self, acc, lse, blk, rows, o_p, l_p):
        a, l_acc = self._chunk(acc, blk.q_chunk), self._chunk(lse, blk.q_chunk)
        if rows is None:
            o, l_new = merge_pair(a, l_acc, o_p, l_p)
            a.copy_(o)
            l_acc.copy_(l_new)
            return
        idx = rows[0]
        d = a.shape[-1]
        idx4 = idx[..., None].expand(-1, -1, -1, d)
        o, l_new = merge_pair(a.gather(2, idx4), l_acc.gather(2, idx), o_p, l_p)
        a.scatter_(2, idx4, o)
        l_acc.scatter_(2, idx, l_new)

    # -- backward --------------------------------------------------------------------------------------
    def backward(self, q, k, v, out, lse, sel, dout):
        self._setup(q, sel)
        b, h, n_local, d = q.shape
        qf, do = q.float(), dout.float()
        delta = (do * out.float()).sum(-1)  # rowsum(dO * O), [b, h, n/d]
        dq = torch.zeros_like(qf)
        kv = torch.cat([k, v], dim=-1)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        waits, grads_in = [], []
        tag0 = 2 * self.world
        pending = self._exchange(1, kv, "backward", tag=tag0 + 1)
        for t in range(self.world):
            if t == 0:
                block_kv, index, nxt = kv, None, pending
            else:
                work, buf, s = pending
                waits += s
                if work is not None:
                    work.wait()
                block_kv, index = buf, self.plan.needed(self.rank, t)
                nxt = self._exchange(t + 1, kv, "backward", tag=tag0 + t + 1)
                # as an owner: the dK/dV of our chunks that rank (r + t) computes in this round
                dst = self.plan.dst(self.rank, t)
                theirs = self.plan.needed(dst, t)
                if theirs:
                    gbuf = torch.empty((*kv.shape[:2], len(theirs) * self.c, 2 * d), dtype=torch.float32,
                                       device=q.device)
                    gw = dist.irecv(gbuf, self._peer(dst), group=self.group, tag=3 * self.world + t)
                    self._count("backward", bytes_received=gbuf.nbytes)
                    grads_in.append((gw, gbuf, theirs))
            blocks = self.plan.blocks(self.rank, t)
            dblock = torch.zeros(block_kv.shape, dtype=torch.float32, device=q.device) if blocks else None
            if blocks:
                self._count("backward", rounds=1)
            for blk in blocks:
                j, kb, vb, rows, mask, logits = self._block_inputs(blk, t, block_kv, index, sel, d)
                sl = [self._chunk(x, blk.q_chunk) for x in (qf, do, out, lse, delta)]
                if rows is not None:
                    idx = rows[0]
                    sl = [x.gather(2, idx[..., None].expand(-1, -1, -1, d)) if x.dim() == 4 else x.gather(2, idx)
                          for x in sl]
                dq_p, dk_p, dv_p = _attend_backward(*sl, kb, vb, mask, self.scale, logits)
                self._count("backward", flops=10 * b * h * sl[0].shape[2] * kb.shape[2] * d)
                dq_c = self._chunk(dq, blk.q_chunk)
                if rows is None:
                    dq_c += dq_p
                else:
                    dq_c.scatter_add_(2, rows[0][..., None].expand(-1, -1, -1, d), dq_p)
                self._chunk(dblock, j).add_(torch.cat([dk_p, dv_p], dim=-1))
            if t == 0:
                if dblock is not None:
                    dkv += dblock
            elif dblock is not None:
                src = self.plan.src(self.rank, t)
                waits.append((dist.isend(dblock, self._peer(src), group=self.group, tag=3 * self.world + t), dblock))
                self._count("backward", bytes_sent=dblock.nbytes)
            pending = nxt
        for w, _ in waits + pending[2]:
            w.wait()
        for gw, gbuf, theirs in grads_in:
            gw.wait()
            for pos, j in enumerate(theirs):
                self._chunk(dkv, j).add_(self._chunk(gbuf, pos))
        dk, dv = dkv.split(d, dim=-1)
        return dq, dk, dv


def _attend(q, k, v, mask, scale, logits=None):
    """Normalised partial attention of q [b, h, m, d] over one key block and its log-sum-exp (fp32)."""
    h = q.shape[1]
    kr = repeat_kv(k, h)
    s = (q @ kr.transpose(-1, -2)) * scale if logits is None else logits(q, kr).float()
    p, lse = softmax_lse(s.masked_fill(~mask, NEG_INF))
    return p @ repeat_kv(v, h), lse


def _attend_backward(q, do, out, lse, delta, k, v, mask, scale, logits=None):
    """Gradients of one block from the final output's log-sum-exp (the flash-attention backward); with a
    ``logits`` function, dS goes back through it by autograd."""
    b, h, m, d = q.shape
    hkv = k.shape[1]
    kr, vr = repeat_kv(k, h), repeat_kv(v, h)
    if logits is None:
        s = (q @ kr.transpose(-1, -2)) * scale
    else:
        with torch.enable_grad():
            qg, kg = q.detach().requires_grad_(True), kr.detach().requires_grad_(True)
            s_g = logits(qg, kg).float()
        s = s_g.detach()
    p = torch.exp(s.masked_fill(~mask, NEG_INF) - clamp_empty(lse)[..., None])
    dv = p.transpose(-1, -2) @ do
    dp = do @ vr.transpose(-1, -2)
    ds = p * (dp - delta[..., None])
    if logits is None:
        dq = (ds @ kr) * scale
        dk = (ds.transpose(-1, -2) @ q) * scale
    else:
        dq, dk = torch.autograd.grad(s_g, (qg, kg), ds)
    fold = lambda x: x.view(b, hkv, h // hkv, *x.shape[2:]).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)
