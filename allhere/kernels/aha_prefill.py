"""AHA prefill in Triton (inference, no grad): a sliding-window kernel for every query, then a kernel
for the global (query, head) pairs only, packed per (batch, head) with their own count.

Packing: the global pairs are listed in (batch, head, position) order and cut into blocks of BLOCK_M
pairs of one (batch, head); each program of the global kernel takes one block (never padded to the
busiest head: a head with 3 global queries gets one block of 3 rows), reads keys from 0 to the block's
last position with a per-row causal mask, and writes its rows over the local result in place. The local
result of a global query is computed and overwritten (a fraction mu_f of the local work).

Layout: q [b, h, n, d], k/v [b, kv_heads, n, d] (queries and keys over the same n positions), head dim
a power of two >= 16. Online softmax in fp32, output in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_block(q, k_ptrs, v_ptrs, kmask, valid, m_i, l_i, acc, sm_scale):
    """One key block of an online softmax: returns the updated (m, l, acc)."""
    k = tl.load(k_ptrs, mask=kmask, other=0.0)
    v = tl.load(v_ptrs, mask=kmask, other=0.0)
    s = tl.dot(q, tl.trans(k)) * sm_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def window_block(N, H, G, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's query block (program ids: block, batch * heads + head): (b * h + h, b, h, kv head,
    row offsets, and the key range [lo, hi) its windows reach, lo aligned to BLOCK_N)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit: b * stride may pass 2**31
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = (tl.maximum(pid_m * BLOCK_M - W + 1, 0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum((pid_m + 1) * BLOCK_M, N)
    return bh, b, h, h // G, offs_m, lo, hi


@triton.jit
def _sliding_kernel(Q, K, V, O, LSE, sm_scale, N, H, G, W,
                    sqb, sqh, sqn, skb, skh, skn, sob, soh, son,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, STORE_LSE: tl.constexpr):
    bh, b, h, kh, offs_m, lo, hi = window_block(N, H, G, W, BLOCK_M, BLOCK_N)
    offs_d = tl.arange(0, D)
    qmask = offs_m[:, None] < N
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv = b * skb + kh * skh + offs_n[:, None] * skn + offs_d[None, :]
        diff = offs_m[:, None] - offs_n[None, :]
        valid = (diff >= 0) & (diff < W) & (offs_n[None, :] < N)
        m_i, l_i, acc = _online_block(q, K + kv, V + kv, offs_n[:, None] < N, valid, m_i, l_i, acc, sm_scale)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty), mask=qmask)
    if STORE_LSE:
        tl.store(LSE + bh * N + offs_m, m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)), mask=offs_m < N)


@triton.jit
def packed_block(ROWS, BLK_BH, BLK_START, BLK_COUNT, blk, H, G, BLOCK_M: tl.constexpr):
    """Packed block ``blk`` of the global pairs: (b * h + h, b, h, kv head, row mask, positions)."""
    bh = tl.load(BLK_BH + blk)
    first = tl.load(BLK_START + blk)
    count = tl.load(BLK_COUNT + blk)
    b = (bh // H).to(tl.int64)  # 64-bit: b * stride may pass 2**31
    h = bh % H
    i = tl.arange(0, BLOCK_M)
    rmask = i < count
    pos = tl.load(ROWS + first + i, mask=rmask, other=0)
    return bh, b, h, h // G, rmask, pos


@triton.jit
def _global_kernel(Q, K, V, O, LSE, ROWS, BLK_BH, BLK_START, BLK_COUNT, sm_scale, N, H, G,
                   sqb, sqh, sqn, skb, skh, skn, sob, soh, son,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, STORE_LSE: tl.constexpr):
    bh, b, h, kh, rmask, pos = packed_block(ROWS, BLK_BH, BLK_START, BLK_COUNT, tl.program_id(0), H, G, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + pos[:, None] * sqn + offs_d[None, :], mask=rmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    last = tl.max(tl.where(rmask, pos, 0), 0)
    for start in range(0, last + 1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv = b * skb + kh * skh + offs_n[:, None] * skn + offs_d[None, :]
        valid = (offs_n[None, :] <= pos[:, None]) & rmask[:, None]
        m_i, l_i, acc = _online_block(q, K + kv, V + kv, offs_n[:, None] <= last, valid, m_i, l_i, acc, sm_scale)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + b * sob + h * soh + pos[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None])
    if STORE_LSE:
        tl.store(LSE + bh * N + pos, m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)), mask=rmask)


def pack_global(hard: torch.Tensor, block_m: int):
    """(rows, block bh, block start, block count) of the global pairs of a [b, h, n] bool gate, packed per
    (batch, head) in blocks of at most ``block_m`` pairs. One host sync (the number of blocks)."""
    b, h, n = hard.shape
    flat = hard.reshape(b * h, n)
    idx = flat.nonzero()  # [P, 2] (bh, position), sorted
    counts = flat.sum(1)
    blocks = (counts + block_m - 1) // block_m
    nblocks = int(blocks.sum())
    blk_bh = torch.repeat_interleave(torch.arange(b * h, device=hard.device), blocks)
    seg_start = torch.cumsum(counts, 0) - counts
    blk_first = torch.cumsum(blocks, 0) - blocks
    within = torch.arange(nblocks, device=hard.device) - blk_first[blk_bh]
    start = seg_start[blk_bh] + within * block_m
    count = torch.clamp(counts[blk_bh] - within * block_m, max=block_m)
    as32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return as32(idx[:, 1]), as32(blk_bh), as32(start), as32(count)


def aha_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hard: torch.Tensor, window: int,
                       scale: float, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                       num_stages: int = 3) -> torch.Tensor:
    """AHA forward for queries and keys over the same positions; ``hard`` [b, h, n] bool (True = global).
    block_m: query rows per program (and packed pairs per block); block_n: keys per step; num_warps,
    num_stages: Triton's launch settings (``benchmarks/kernel_tiles.py`` times the choices)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    sliding_forward(q, k, v, out, None, window, scale, tiles)
    global_forward(q, k, v, out, None, pack_global(hard, block_m), scale, tiles)
    return out


def sliding_forward(q, k, v, out, lse, window, scale, tiles: dict) -> None:
    """The sliding-window kernel: writes every query's local output into ``out`` and, unless ``lse`` is
    None, its log-sum-exp (natural log of the scaled scores) into ``lse`` [b * h, n] fp32. ``tiles``:
    BLOCK_M, BLOCK_N, num_warps, num_stages."""
    b, h, n, d = q.shape
    strides = (*q.stride()[:3], *k.stride()[:3], *out.stride()[:3])
    _sliding_kernel[(triton.cdiv(n, tiles["BLOCK_M"]), b * h)](
        q, k, v, out, out if lse is None else lse, scale, n, h, h // k.shape[1], window, *strides, D=d,
        STORE_LSE=lse is not None, **tiles)


def global_forward(q, k, v, out, lse, packed, scale, tiles: dict) -> None:
    """The global kernel over ``packed`` (from ``pack_global`` with block_m = tiles["BLOCK_M"]): overwrites
    those rows of ``out`` (and of ``lse`` unless it is None) with full causal attention."""
    rows, blk_bh, blk_start, blk_count = packed
    if not blk_bh.numel():
        return
    b, h, n, d = q.shape
    strides = (*q.stride()[:3], *k.stride()[:3], *out.stride()[:3])
    _global_kernel[(blk_bh.numel(),)](q, k, v, out, out if lse is None else lse, rows, blk_bh, blk_start,
                                      blk_count, scale, n, h, h // k.shape[1], *strides, D=d,
                                      STORE_LSE=lse is not None, **tiles)
