"""AHA training in Triton: the straight-through forward, and a backward as sparse as inference.

Forward: the prefill kernels of ``aha_prefill`` (sliding window for every query, then the packed global
pairs), keeping each row's log-sum-exp; the local output of every query is returned too, because the
router's gradient needs ``a_full - a_local``.

Backward (FlashAttention-2 style: probabilities recomputed from the saved log-sum-exp). A gradient flows
only into the output that was used, so each row is differentiated through its own pattern:
  - dQ: local rows over their window (one program per query block), then global rows over their prefix
    (one program per packed block, as in the forward), written in place over the zero rows the first
    kernel left for them;
  - dK / dV: one program per key block and kv head, looping over the query heads that share it: the
    local rows whose window covers the block, then the packed global blocks of those heads that reach
    it (rows are sorted by position, so a packed block ending before the key block is skipped).
No work is done for the full attention of local rows: the op computes ``a_full`` for the router's
gradient separately, with dense SDPA and without autograd (a forward pass only).

Layout as in ``aha_prefill``: q [b, h, n, d], k/v [b, kv_heads, n, d], head dim a power of two >= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aha_prefill import global_forward, pack_global, packed_block, sliding_forward, window_block


@triton.jit
def _grad_block(q, k, v, do, lse, delta, valid, sm_scale):
    """Probabilities p and score gradients ds (d loss / d scaled score) of one [rows, keys] tile."""
    s = tl.dot(q, tl.trans(k)) * sm_scale
    p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    return p, p * (dp - delta[:, None])


@triton.jit
def _rows(Q, DO, LSE, DELTA, qo, lo, rmask):
    """q, dO, log-sum-exp and delta of a tile of query rows: element offsets ``qo``, row offsets ``lo``."""
    q = tl.load(Q + qo, mask=rmask[:, None], other=0.0)
    do = tl.load(DO + qo, mask=rmask[:, None], other=0.0)
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
def _local_dq_kernel(Q, K, V, DO, LSE, DELTA, HARD, DQ, sm_scale, N, H, G, W,
                     sqb, sqh, sqn, skb, skh, skn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    bh, b, h, kh, offs_m, lo, hi = window_block(N, H, G, W, BLOCK_M, BLOCK_N)
    offs_d = tl.arange(0, D)
    mmask = offs_m < N
    qo = b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :]
    q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, bh * N + offs_m, mmask)
    local = tl.load(HARD + bh * N + offs_m, mask=mmask, other=1) == 0
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv = b * skb + kh * skh + offs_n[:, None] * skn + offs_d[None, :]
        k = tl.load(K + kv, mask=offs_n[:, None] < N, other=0.0)
        v = tl.load(V + kv, mask=offs_n[:, None] < N, other=0.0)
        diff = offs_m[:, None] - offs_n[None, :]
        valid = (diff >= 0) & (diff < W) & local[:, None] & (offs_n[None, :] < N)
        p, ds = _grad_block(q, k, v, do, lse, delta, valid, sm_scale)
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + qo, (dq * sm_scale).to(DQ.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _global_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, ROWS, CUM, sm_scale, N, H, G,
                      sqb, sqh, sqn, skb, skh, skn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    bh = tl.program_id(1)
    blk = tl.num_programs(0) - 1 - tl.program_id(0)  # a head's last (longest) block first
    count, b, h, kh, rmask, pos = packed_block(ROWS, CUM, blk, bh, N, H, G, BLOCK_M)
    if count <= 0:
        return
    offs_d = tl.arange(0, D)
    qo = b * sqb + h * sqh + pos[:, None] * sqn + offs_d[None, :]
    q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, bh * N + pos, rmask)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    last = tl.max(tl.where(rmask, pos, 0), 0)
    for start in range(0, last + 1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv = b * skb + kh * skh + offs_n[:, None] * skn + offs_d[None, :]
        k = tl.load(K + kv, mask=offs_n[:, None] <= last, other=0.0)
        v = tl.load(V + kv, mask=offs_n[:, None] <= last, other=0.0)
        valid = (offs_n[None, :] <= pos[:, None]) & rmask[:, None]
        p, ds = _grad_block(q, k, v, do, lse, delta, valid, sm_scale)
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + qo, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, HARD, DK, DV, ROWS, CUM, sm_scale, N, H, G, W,
                 sqb, sqh, sqn, skb, skh, skn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
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
    hi = tl.minimum(n0 + BLOCK_N + W - 1, N)
    i = tl.arange(0, BLOCK_M)
    for gi in range(0, G):
        h = kh * G + gi
        bh = b * H + h
        # Local rows whose window reaches this key block.
        for start in range(lo, hi, BLOCK_M):
            offs_m = start + i
            mmask = offs_m < N
            qo = b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :]
            q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, bh * N + offs_m, mmask)
            local = tl.load(HARD + bh * N + offs_m, mask=mmask, other=1) == 0
            diff = offs_m[:, None] - offs_n[None, :]
            valid = (diff >= 0) & (diff < W) & local[:, None] & nmask[None, :]
            dk, dv = _kv_grads(q, k, v, do, lse, delta, valid, dk, dv, sm_scale)
        # Packed global blocks of this head that reach the key block: from the one holding its first
        # global query at or after n0 (the count before n0, divided by BLOCK_M) to its last block.
        total = tl.load(CUM + bh * N + N - 1)
        before = tl.load(CUM + bh * N + n0 - 1, mask=n0 > 0, other=0)
        for blk in range(before // BLOCK_M, tl.cdiv(total, BLOCK_M)):
            rmask = i < total - blk * BLOCK_M
            pos = tl.load(ROWS + bh * (N + 1) + blk * BLOCK_M + i, mask=rmask, other=0)
            qo = b * sqb + h * sqh + pos[:, None] * sqn + offs_d[None, :]
            q, do, lse, delta = _rows(Q, DO, LSE, DELTA, qo, bh * N + pos, rmask)
            valid = (offs_n[None, :] <= pos[:, None]) & rmask[:, None] & nmask[None, :]
            dk, dv = _kv_grads(q, k, v, do, lse, delta, valid, dk, dv, sm_scale)
    tl.store(DK + kv, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask[:, None])
    tl.store(DV + kv, dv.to(DV.dtype.element_ty), mask=nmask[:, None])


class _AHATrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, hard, window, scale, tiles):
        b, h, n, _ = q.shape
        q, k, v = (t.contiguous() for t in (q, k, v))
        a_local = torch.empty_like(q)
        lse = torch.empty(b * h, n, device=q.device, dtype=torch.float32)
        sliding_forward(q, k, v, a_local, lse, window, scale, tiles)
        out = a_local.clone()
        packed = pack_global(hard)
        global_forward(q, k, v, out, lse, packed, scale, tiles)
        ctx.save_for_backward(q, k, v, out, lse, hard, *packed)
        ctx.config = (window, scale, tiles)
        ctx.mark_non_differentiable(a_local)
        return out, a_local

    @staticmethod
    def backward(ctx, dout, _unused):
        q, k, v, out, lse, hard, rows, cum = ctx.saved_tensors
        window, scale, tiles = ctx.config
        block_m, block_n = tiles["BLOCK_M"], tiles["BLOCK_N"]
        b, h, n, d = q.shape
        hkv = k.shape[1]
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).reshape(b * h, n)
        hard8 = hard.reshape(b * h, n).to(torch.int8)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        strides = (*q.stride()[:3], *k.stride()[:3])
        _local_dq_kernel[(triton.cdiv(n, block_m), b * h)](q, k, v, dout, lse, delta, hard8, dq, scale, n, h,
                                                           h // hkv, window, *strides, D=d, **tiles)
        _global_dq_kernel[(triton.cdiv(n, block_m), b * h)](q, k, v, dout, lse, delta, dq, rows, cum, scale, n, h,
                                                            h // hkv, *strides, D=d, **tiles)
        _dkdv_kernel[(triton.cdiv(n, block_n), b * hkv)](q, k, v, dout, lse, delta, hard8, dk, dv, rows, cum, scale,
                                                         n, h, h // hkv, window, *strides, D=d, **tiles)
        return dq, dk, dv, None, None, None, None


def aha_train_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hard: torch.Tensor, window: int,
                     scale: float, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, a_local): ``out`` is AHA's output under the hard gate [b, h, n] (True = global),
    differentiable in q, k, v through the used path only; ``a_local`` is every query's sliding-window
    output, without gradient (for the straight-through term). Tiles as in ``aha_prefill_triton``, the
    same for the forward and backward kernels."""
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return _AHATrain.apply(q, k, v, hard, window, scale, tiles)
