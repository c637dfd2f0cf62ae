"""AHA training in Triton: the straight-through forward, and a backward as sparse as inference.

Forward: the prefill kernels of ``aha_prefill`` (sliding window for every query, then the packed global
pairs), keeping each row's log-sum-exp; the local output of every query is returned too, because the
router's gradient needs ``a_full - a_local``.

Backward (FlashAttention-2 style: probabilities recomputed from the saved log-sum-exp). A gradient flows
only into the output that was used, so each row is differentiated through its own pattern:
  - dQ: every row over its window (one program per query block; no gate test per pair), then the global
    rows over their prefix (one program per packed block, as in the forward), written in place over the
    window gradient the first kernel computed for them; both mask only the edge key blocks, as the
    forward does;
  - dK / dV: one program per key block and kv head, looping over the query heads that share it: the
    local rows whose window covers the block, then the packed global blocks of those heads that reach
    it (rows are sorted by position, so a packed block ending before the key block is skipped).
With sinks (``sinks`` = S > 0: a local row also reads the first S keys of its segment), the (row, sink) pairs
outside the rows' windows are differentiated where their rows are, in the local dQ kernel, in a pass of its
own over the sink blocks (``aha_common.sink_blocks``): their dQ directly, their dK / dV added atomically to an
fp32 scratch that the dK / dV kernel adds to the keys' gradients. Every later local row of a segment reads
its sinks: a dK / dV program looping over all of them would run on alone, as long as the sequence, after
the others; the query blocks share that work instead. S is a constexpr: S = 0 compiles the kernels without
any of it. (Atomic adds in any order: the sink keys' dK / dV may differ from run to run in the last bits.)
No work is done for the full attention of local rows: the op computes ``a_full`` for the router's
gradient separately, with dense SDPA and without autograd (a forward pass only).

Layout as in ``aha_prefill``: q [b, h, n, d], k/v [b, kv_heads, n, d], head dim a power of two >= 16. The
backward's kernels are built from ``aha_common`` as the forward's are (the window rule, the edge masks, the key
loads, the rows a program takes).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import aha_common, autotune
from .aha_pack import pack_global, work_order
from .aha_prefill import global_forward, sliding_forward


@triton.jit
def _grad_block(q, k, v, do, lse, delta, valid, sm_scale, MASKED: tl.constexpr = True):
    """Probabilities p and score gradients ds (d loss / d scaled score) of one [rows, keys] tile; without
    MASKED every pair of the tile counts (``valid`` is not read)."""
    p = tl.exp(tl.dot(q, tl.trans(k)) * sm_scale - lse[:, None])
    if MASKED:
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    return p, p * (dp - delta[:, None])


@triton.jit
def _dq_blocks(q, do, lse, delta, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, hi, dq, sm_scale,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """``dq`` (unscaled) plus the key blocks [lo, hi) of ``rows``; MASKED as in ``aha_prefill._attend``."""
    for start in range(lo, hi, BLOCK_N):
        offs_n, k, v = aha_common.load_keys(K, V, kbase, kb, kh, skn, start, N, MASKED, BLOCK_N, D, TMA)
        if MASKED:
            valid = aha_common.edge_mask(rows, offs_n, first, rmask, N, W)
        else:
            valid = rmask  # not read
        p, ds = _grad_block(q, k, v, do, lse, delta, valid, sm_scale, MASKED)
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _dq_rows(q, do, lse, delta, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, hi, sm_scale,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """dQ (unscaled, fp32) of ``rows`` over the key blocks [lo, hi), masked on the edges only."""
    inner_lo, inner_hi = aha_common.inner_blocks(rows, first, rmask, N, W, lo, hi, BLOCK_N)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    dq = _dq_blocks(q, do, lse, delta, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, inner_lo, dq,
                    sm_scale, True, BLOCK_N, D, TMA)
    dq = _dq_blocks(q, do, lse, delta, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, inner_lo, inner_hi, dq,
                    sm_scale, False, BLOCK_N, D, TMA)
    return _dq_blocks(q, do, lse, delta, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, inner_hi, hi, dq,
                      sm_scale, True, BLOCK_N, D, TMA)


@triton.jit
def _rows(Q, DO, LSE, DELTA, qo, doo, lo, rmask):
    """q, dO, log-sum-exp and delta of a tile of query rows: element offsets ``qo`` (q) and ``doo`` (dO),
    row offsets ``lo``."""
    q = tl.load(Q + qo, mask=rmask[:, None], other=0.0)
    do = tl.load(DO + doo, mask=rmask[:, None], other=0.0)
    lse = tl.load(LSE + lo, mask=rmask, other=0.0)
    delta = tl.load(DELTA + lo, mask=rmask, other=0.0)
    return q, do, lse, delta


@triton.jit
def _kv_grads(q, k, v, do, lse, delta, valid, dk, dv, sm_scale):
    """A tile of rows added to a key block's dK (unscaled) and dV accumulators."""
    p, ds = _grad_block(q, k, v, do, lse, delta, valid, sm_scale)
    dv += tl.dot(tl.trans(p).to(do.dtype), do)
    dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    return dk, dv


@triton.jit
def _sink_grads(q, do, lse, delta, K, V, kbase, kb, kh, skn, rows, first, local, N, W, dq, SCRATCH, sbase, half,
                sm_scale, S, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """The pairs of the local ``rows`` (mask ``local``) with the first S keys of their segments (from ``first``)
    that their windows do not hold (``aha_prefill._attend_sinks``' keys): returns ``dq`` plus theirs, and adds
    their dK (unscaled) and dV atomically to the fp32 SCRATCH, key j's at ``sbase`` + j * D and ``half`` on."""
    end = aha_common.sink_end(first, aha_common.window_start(rows, W), S)
    lo, hi = aha_common.sink_blocks(first, end, local, N, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        offs_n, k, v = aha_common.load_keys(K, V, kbase, kb, kh, skn, start, hi, True, BLOCK_N, D, TMA)
        p, ds = _grad_block(q, k, v, do, lse, delta, aha_common.sink_mask(offs_n, first, end, local), sm_scale)
        dq += tl.dot(ds.to(k.dtype), k)
        at = SCRATCH + sbase + offs_n[:, None] * D + tl.arange(0, D)[None, :]
        keys = (offs_n < hi)[:, None]
        tl.atomic_add(at, tl.dot(tl.trans(ds).to(q.dtype), q), mask=keys, sem="relaxed")
        tl.atomic_add(at + half, tl.dot(tl.trans(p).to(do.dtype), do), mask=keys, sem="relaxed")
    return dq


@triton.jit
def _local_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, START, HARD, SCRATCH, sm_scale, B, N, H, G, W, R, half,
                     sqb, sqh, sqn, skb, skh, skn, sdb, sdh, sdn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, SEGMENTS: tl.constexpr,
                     TMA: tl.constexpr = False, SINKS: tl.constexpr = 0):
    bh, b, h, kh, offs_m, lo, hi = aha_common.window_block(N, H, G, W, BLOCK_M, BLOCK_N)
    K, V = aha_common.key_sources(K, V, B, H // G, N, skb, skh, skn, BLOCK_N, D, TMA)
    offs_d = tl.arange(0, D)
    mmask = offs_m < N
    qo = b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :]
    doo = b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :]  # dO and dQ share a layout
    q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, doo, bh * N + offs_m, mmask)
    first = aha_common.row_starts(START, b, N, offs_m, mmask, SEGMENTS)
    # Every row, global ones too (no gate test per pair): the global dQ kernel overwrites those rows.
    dq = _dq_rows(q, do, lse, delta, K, V, b * skb + kh * skh, b.to(tl.int32), kh, skn, offs_m, first, mmask, N, W,
                  lo, hi, sm_scale, BLOCK_M, BLOCK_N, D, TMA)
    if SINKS > 0:  # the local rows' sinks outside their windows; their dK / dV into SCRATCH [2, B, H // G, R, D]
        local = mmask & (tl.load(HARD + bh * N + offs_m, mask=mmask, other=1) == 0)
        dq = _sink_grads(q, do, lse, delta, K, V, b * skb + kh * skh, b.to(tl.int32), kh, skn, offs_m, first, local, N,
                         W, dq, SCRATCH, (b * (H // G) + kh) * R * D, half, sm_scale, SINKS, BLOCK_N, D, TMA)
    tl.store(DQ + doo, (dq * sm_scale).to(DQ.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _global_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, ROWS, CUM, ORDER, START, sm_scale, B, N, H, G,
                      sqb, sqh, sqn, skb, skh, skn, sdb, sdh, sdn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, SEGMENTS: tl.constexpr,
                      ORDERED: tl.constexpr, TMA: tl.constexpr = False):
    count, bh, b, h, kh, rmask, pos = aha_common.packed_block(ROWS, CUM, ORDER, B, N, H, G, BLOCK_M, ORDERED)
    if count <= 0:
        return
    K, V = aha_common.key_sources(K, V, B, H // G, N, skb, skh, skn, BLOCK_N, D, TMA)
    offs_d = tl.arange(0, D)
    qo = b * sqb + h * sqh + pos[:, None] * sqn + offs_d[None, :]
    doo = b * sdb + h * sdh + pos[:, None] * sdn + offs_d[None, :]
    q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, doo, bh * N + pos, rmask)
    first, lo, last = aha_common.packed_keys(START, b, N, pos, rmask, SEGMENTS, BLOCK_N)
    dq = _dq_rows(q, do, lse, delta, K, V, b * skb + kh * skh, b.to(tl.int32), kh, skn, pos, first, rmask, N, N, lo,
                  last + 1, sm_scale, BLOCK_M, BLOCK_N, D, TMA)
    tl.store(DQ + doo, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, HARD, DK, DV, ROWS, CUM, START, SEG_END, SCRATCH, sm_scale, N, H, G, W,
                 R, half, sqb, sqh, sqn, skb, skh, skn, sdb, sdh, sdn, sgb, sgh, sgn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, SEGMENTS: tl.constexpr,
                 SINKS: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    bkh = tl.program_id(1)  # batch * kv_heads + kv head
    hkv = H // G
    b = (bkh // hkv).to(tl.int64)  # 64-bit: b * stride may pass 2**31
    kh = bkh % hkv
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    nmask = offs_n < N
    kv = b * skb + kh * skh + offs_n[:, None] * skn + offs_d[None, :]
    k = tl.load(K + kv, mask=nmask[:, None], other=0.0)
    v = tl.load(V + kv, mask=nmask[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    lo = (n0 // BLOCK_M) * BLOCK_M
    hi = tl.minimum(aha_common.last_reader(n0 + BLOCK_N - 1, W) + 1, N)  # the local rows whose window reaches the block
    i = tl.arange(0, BLOCK_M)
    # No query at or after ``stop`` sees a key of this block (the end of the last key's segment).
    if SEGMENTS:
        stop = tl.load(SEG_END + b * N + tl.minimum(n0 + BLOCK_N, N) - 1)
    else:
        stop = N
    for gi in range(0, G):
        h = kh * G + gi
        bh = b * H + h
        # Local rows whose window reaches this key block.
        for start in range(lo, hi, BLOCK_M):
            offs_m = start + i
            mmask = offs_m < N
            qo = b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :]
            doo = b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :]
            q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, doo, bh * N + offs_m, mmask)
            local = tl.load(HARD + bh * N + offs_m, mask=mmask, other=1) == 0
            first = aha_common.row_starts(START, b, N, offs_m, mmask, SEGMENTS)
            # local: a real row (padding loads as global)
            valid = aha_common.edge_mask(offs_m, offs_n, first, local, N, W)
            dk, dv = _kv_grads(q, k, v, do, lse, delta, valid, dk, dv, sm_scale)
        # This head's global queries (its packed list, BLOCK_M at a time) that reach the key block: from
        # the tile holding its first global query at or after n0 (the count before n0, divided by
        # BLOCK_M) to the one holding its last global query before ``stop``.
        reach = tl.load(CUM + bh * N + stop - 1)
        before = tl.load(CUM + bh * N + n0 - 1, mask=n0 > 0, other=0)
        for blk in range(before // BLOCK_M, tl.cdiv(reach, BLOCK_M)):
            rmask = i < reach - blk * BLOCK_M
            pos = tl.load(ROWS + bh * (N + 1) + blk * BLOCK_M + i, mask=rmask, other=0)
            qo = b * sqb + h * sqh + pos[:, None] * sqn + offs_d[None, :]
            doo = b * sdb + h * sdh + pos[:, None] * sdn + offs_d[None, :]
            q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, doo, bh * N + pos, rmask)
            first = aha_common.row_starts(START, b, N, pos, rmask, SEGMENTS)
            valid = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] >= first[:, None]) & rmask[:, None] \
                & nmask[None, :]
            dk, dv = _kv_grads(q, k, v, do, lse, delta, valid, dk, dv, sm_scale)
    if SINKS > 0:  # the sink keys' pairs with the local rows past their windows (``_sink_grads``; zero elsewhere)
        at = SCRATCH + (b * hkv + kh) * R * D + offs_n[:, None] * D + offs_d[None, :]
        dk += tl.load(at, mask=(offs_n < R)[:, None], other=0.0)
        dv += tl.load(at + half, mask=(offs_n < R)[:, None], other=0.0)
    grad = b * sgb + kh * sgh + offs_n[:, None] * sgn + offs_d[None, :]  # dK and dV share a layout
    tl.store(DK + grad, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask[:, None])
    tl.store(DV + grad, dv.to(DV.dtype.element_ty), mask=nmask[:, None])


class _AHATrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, hard, window, scale, tiles, dkdv, start, sinks):
        b, h, n, _ = q.shape
        q, k, v = aha_common.strided(q, k, v)
        a_local = torch.empty_like(q)
        lse = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
        sliding_forward(q, k, v, a_local, lse, start, window, scale, aha_common.pinned_tiles("sliding", tiles), sinks)
        out = a_local.clone()
        packed = pack_global(hard)
        global_forward(q, k, v, out, lse, start, packed, scale, aha_common.pinned_tiles("global", tiles))
        ctx.save_for_backward(q, k, v, out, lse, hard, start, *packed)
        ctx.config = (window, scale, tiles, dkdv, sinks, autotune.pins())  # the backward may run on another thread
        ctx.mark_non_differentiable(a_local)
        return out, a_local

    @staticmethod
    def backward(ctx, dout, _unused):
        q, k, v, out, lse, hard, start, rows, cum = ctx.saved_tensors
        window, scale, tiles, dkdv, sinks, pins = ctx.config
        b, h, n, d = q.shape
        hkv = k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # dk, dv: one layout, as k, v
        if dout.stride() != dq.stride():  # dO is read with dQ's strides
            dout = torch.empty_like(dq).copy_(dout)
        delta = (dout.float() * out.float()).sum(-1).reshape(b * h, n)
        hard8 = hard.reshape(b * h, n).to(torch.int8)
        strides = (*q.stride()[:3], *k.stride()[:3], *dq.stride()[:3])
        seg_end = cum if start is None else segment_end(start)
        start, segments = aha_common.segment_args(start, cum)
        common = dict(D=d, SEGMENTS=segments)
        # The sink keys' dK / dV from the local dQ kernel (fp32 [2, b, hkv, keys, d] by key position, zero past the
        # sinks: the first ``sinks`` keys, or every key where segments put sinks anywhere); without sinks unused.
        keys = (n if segments else sinks) if sinks else 0
        scratch = torch.empty(2 * b * hkv * keys * d, device=q.device, dtype=torch.float32) if sinks else cum
        sink_args = (keys, b * hkv * keys * d)

        def local_dq(t: dict) -> None:
            if sinks:
                scratch.zero_()  # added to atomically: every launch (the tuner's too) starts from zero
            _local_dq_kernel[(triton.cdiv(n, t["BLOCK_M"]), b * h)](q, k, v, dout, lse, delta, dq, start, hard8,
                                                                    scratch, scale, b, n, h, h // hkv, window,
                                                                    *sink_args, *strides, **common, SINKS=sinks,
                                                                    **aha_common.tma_checked(t, k))

        def global_dq(t: dict) -> None:
            order, programs = work_order(rows, cum, t["BLOCK_M"])
            _global_dq_kernel[(programs,)](q, k, v, dout, lse, delta, dq, rows, cum, cum if order is None else order,
                                           start, scale, b, n, h, h // hkv, *strides, **common,
                                           ORDERED=order is not None, **aha_common.tma_checked(t, k))

        def dkdv_grads(t: dict) -> None:
            _dkdv_kernel[(triton.cdiv(n, t["BLOCK_N"]), b * hkv)](q, k, v, dout, lse, delta, hard8, dk, dv, rows, cum,
                                                                  start, seg_end, scratch, scale, n, h, h // hkv,
                                                                  window, *sink_args, *strides, *dk.stride()[:3],
                                                                  **common, SINKS=sinks, **t)

        with contextlib.nullcontext() if pins is None else autotune.pinned(pins):
            for name, launch, pinned in (("local_dq", local_dq, tiles), ("global_dq", global_dq, tiles),
                                         ("dkdv", dkdv_grads, dkdv)):
                launch(aha_common.pinned_tiles(name, pinned) or aha_common.choose(name, q, k, launch))
        return dq, dk, dv, None, None, None, None, None, None, None


def segment_end(start: torch.Tensor) -> torch.Tensor:
    """For the dK / dV kernel: per position, one past the last query of its segment ([b, n] int32; runs
    of equal ``start``: a segment, or queries that see nothing). Queries after it start later, so none
    of them sees this key."""
    b, n = start.shape
    later = torch.arange(1, n, device=start.device, dtype=torch.int32)
    new_run = torch.where(start[:, 1:] != start[:, :-1], later, n)  # [b, n - 1]: a run starts at 1..n-1
    end = torch.full((b, n), n, device=start.device, dtype=torch.int32)
    end[:, :-1] = new_run.flip(1).cummin(1).values.flip(1)
    return end


def aha_train_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hard: torch.Tensor, window: int,
                     scale: float, tiles: dict | None = None, dkdv: dict | None = None,
                     row_start: torch.Tensor | None = None, sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, a_local): ``out`` is AHA's output under the hard gate [b, h, n] (True = global),
    differentiable in q, k, v through the used path only; ``a_local`` is every query's sliding-window
    output, without gradient (for the straight-through term). q, k, v are read where they lie
    (``aha_common.strided``). tiles: None, each kernel's setting from ``allhere.kernels.autotune``; or one
    pinned for the forward and dQ kernels, as in ``aha_prefill_triton``; dkdv: the same for the dK / dV
    kernel (BLOCK_M: query rows at a time, BLOCK_N: keys per program). ``row_start``: segments, as in
    ``aha_prefill_triton``; sinks: a local row also reads the first ``sinks`` keys of its segment (forward and
    backward)."""
    return _AHATrain.apply(q, k, v, hard, window, scale, tiles, dkdv, aha_common.segment_start(row_start, q.shape[2]),
                           sinks)
