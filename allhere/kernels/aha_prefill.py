"""AHA prefill in Triton (inference, no grad): a sliding-window kernel for every query, then a kernel
for the global (query, head) pairs only, packed per (batch, head) with their own count.

Packing, without a host sync: per (batch, head), the positions of its global queries in increasing
order (``aha_pack.pack_global``: a running count and a scatter, in one launch). The global kernel has one
program per (block of BLOCK_M of those positions, batch * head) for every block a head could have
(n / BLOCK_M); a program past its head's own count returns at once, so the work follows each head's count
(never padded to the busiest head: a head with 3 global queries does one block of 3 rows) while the
grid, known from the shapes alone, needs nothing read back from the GPU. A program reads keys from 0 (or
its earliest row's segment start) to its block's last position with a per-row causal mask and writes its
rows over the local result in place; from ``aha_pack.SORT_FROM`` positions on, the blocks of all heads start
longest first (``aha_pack.longest_first``: the latest last position first), so that no long block is left to
run alone at the end; shorter sequences take a fixed order that needs no sort.
The local result of a global query is computed and overwritten (a fraction mu_f of the local work).

Masks cost only on the edges: in both kernels the key blocks that every row of a block may see entirely
(inside all windows, past all segment starts, before the first row) run without mask work.

Segments (``row_start``: padded sequences, packed documents): each query sees keys from its segment's
start on; all segments run in the same launch.

Sinks (``sinks`` = S > 0, AHA's local branch with attention sinks): a local query also reads the first S keys
of its segment. The sliding kernel folds the ones outside a row's window into its online softmax in a pass of
their own before the window's (``aha_common.sink_blocks``: the one or few key blocks they lie in, skipped where
every window of the tile holds its sinks). S is a constexpr: S = 0 compiles the kernel without that pass.

Layout: q [b, h, n, d], k/v [b, kv_heads, n, d] (queries and keys over the same n positions), head dim
a power of two >= 16 (the op sends 16 to 128 here: at 256 the default tiles need more shared memory than
a GPU gives a block). Online softmax in fp32 (base 2), output in q's dtype.

The pieces the kernels share (the window rule, the online softmax, key loads, the rows a program takes, the
launch helpers) are ``aha_common``'; this file holds the two prefill kernels and their launches
(``sliding_forward``, ``global_forward``), which the training forward (``aha_train``) runs too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aha_common import (
    LN2,
    LOG2E,
    choose,
    edge_mask,
    inner_blocks,
    key_sources,
    load_keys,
    online_step,
    packed_block,
    packed_keys,
    pinned_tiles,
    row_starts,
    segment_args,
    segment_start,
    sink_blocks,
    sink_end,
    strided,
    tma_checked,
    window_block,
    window_start,
)
from .aha_pack import pack_global, work_order


@triton.jit
def _attend(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, hi, m_i, l_i, acc, qk_scale,
            MASKED: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """The key blocks [lo, hi) of an online softmax in base 2 (``qk_scale`` = scale * log2 e) for the query
    positions ``rows``: returns the updated (m, l, acc). MASKED applies causality, the window W, each
    row's first key, the sequence end and the row mask; without it every key of the range must be valid
    for every row (the inner blocks: no mask work, the cost of a dense block)."""
    for start in range(lo, hi, BLOCK_N):
        offs_n, k, v = load_keys(K, V, kbase, kb, kh, skn, start, N, MASKED, BLOCK_N, D, TMA)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = tl.where(edge_mask(rows, offs_n, first, rmask, N, W), s, float("-inf"))
        m_i, l_i, acc = online_step(m_i, l_i, acc, s, v, False)
    return m_i, l_i, acc


@triton.jit
def _attend_sinks(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, m_i, l_i, acc, qk_scale, S,
                  BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """The first S keys of each row's segment (from ``first``) that its window W does not hold, folded into
    the online softmax (``_attend``'s arguments): the updated (m, l, acc). Per row they are the keys
    [first, end): ``_attend``'s masked loop with end - 1 as each row's last key, no window, and the last
    sink block's end as the sequence's (no key after it is loaded)."""
    end = sink_end(first, window_start(rows, W), S)
    lo, hi = sink_blocks(first, end, rmask, N, BLOCK_N)
    return _attend(q, K, V, kbase, kb, kh, skn, end - 1, first, rmask, hi, hi + 1, lo, hi, m_i, l_i, acc, qk_scale,
                   True, BLOCK_N, D, TMA)


@triton.jit
def _attend_rows(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, hi, sm_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr,
                 SINKS: tl.constexpr = 0):
    """Attention of ``rows`` over the key blocks [lo, hi), masked on the edges only (``inner_blocks``), and
    over the first SINKS keys of each row's segment (``_attend_sinks``): (output [BLOCK_M, D] fp32,
    natural-log LSE; a row that saw nothing: 0, -inf)."""
    inner_lo, inner_hi = inner_blocks(rows, first, rmask, N, W, lo, hi, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale = sm_scale * LOG2E
    if SINKS > 0:
        m_i, l_i, acc = _attend_sinks(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, m_i, l_i, acc, qk_scale,
                                      SINKS, BLOCK_N, D, TMA)
    m_i, l_i, acc = _attend(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, inner_lo, m_i, l_i, acc,
                            qk_scale, True, BLOCK_N, D, TMA)
    m_i, l_i, acc = _attend(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, inner_lo, inner_hi, m_i, l_i, acc,
                            qk_scale, False, BLOCK_N, D, TMA)
    m_i, l_i, acc = _attend(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, inner_hi, hi, m_i, l_i, acc,
                            qk_scale, True, BLOCK_N, D, TMA)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None], (m_i + tl.log2(l_safe)) * LN2


@triton.jit
def _sliding_kernel(Q, K, V, O, LSE, START, sm_scale, B, N, H, G, W,
                    sqb, sqh, sqn, skb, skh, skn, sob, soh, son,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, STORE_LSE: tl.constexpr,
                    SEGMENTS: tl.constexpr, TMA: tl.constexpr = False, SINKS: tl.constexpr = 0):
    bh, b, h, kh, offs_m, lo, hi = window_block(N, H, G, W, BLOCK_M, BLOCK_N)
    K, V = key_sources(K, V, B, H // G, N, skb, skh, skn, BLOCK_N, D, TMA)
    offs_d = tl.arange(0, D)
    rmask = offs_m < N
    first = row_starts(START, b, N, offs_m, rmask, SEGMENTS)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=rmask[:, None], other=0.0)
    out, lse = _attend_rows(q, K, V, b * skb + kh * skh, b.to(tl.int32), kh, skn, offs_m, first, rmask, N, W, lo,
                            hi, sm_scale, BLOCK_M, BLOCK_N, D, TMA, SINKS)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None])
    if STORE_LSE:
        tl.store(LSE + bh * N + offs_m, lse, mask=rmask)


@triton.jit
def _global_kernel(Q, K, V, O, LSE, ROWS, CUM, ORDER, START, sm_scale, B, N, H, G,
                   sqb, sqh, sqn, skb, skh, skn, sob, soh, son,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, STORE_LSE: tl.constexpr,
                   SEGMENTS: tl.constexpr, ORDERED: tl.constexpr, TMA: tl.constexpr = False):
    count, bh, b, h, kh, rmask, pos = packed_block(ROWS, CUM, ORDER, B, N, H, G, BLOCK_M, ORDERED)
    if count <= 0:
        return
    K, V = key_sources(K, V, B, H // G, N, skb, skh, skn, BLOCK_N, D, TMA)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + pos[:, None] * sqn + offs_d[None, :], mask=rmask[:, None], other=0.0)
    first, lo, last = packed_keys(START, b, N, pos, rmask, SEGMENTS, BLOCK_N)
    out, lse = _attend_rows(q, K, V, b * skb + kh * skh, b.to(tl.int32), kh, skn, pos, first, rmask, N, N, lo,
                            last + 1, sm_scale, BLOCK_M, BLOCK_N, D, TMA)
    tl.store(O + b * sob + h * soh + pos[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None])
    if STORE_LSE:
        tl.store(LSE + bh * N + pos, lse, mask=rmask)


def aha_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hard: torch.Tensor, window: int,
                       scale: float, tiles: dict | None = None, row_start: torch.Tensor | None = None,
                       sinks: int = 0) -> torch.Tensor:
    """AHA forward for queries and keys over the same positions; ``hard`` [b, h, n] bool (True = global).
    q, k, v are read where they lie (``strided``). tiles: None, each kernel's launch setting from
    ``allhere.kernels.autotune`` (tuned on the GPU, the default in the interpreter); or a setting pinned
    for both kernels (BLOCK_M: query rows per program and packed pairs per block, BLOCK_N: keys per step,
    num_warps, num_stages; what is left out comes from the default). row_start: optional int [b, n] from
    ``allhere.masks.segment_starts``: each query sees only the keys from its segment's start on (-1: none,
    zero output), all segments in the same launch. sinks: a local query also reads the first ``sinks`` keys
    of its segment (of the sequence without ``row_start``)."""
    q, k, v = strided(q, k, v)
    out = torch.empty_like(q)  # q's own layout where q is dense (a transposed projection stays one)
    start = segment_start(row_start, q.shape[2])
    sliding_forward(q, k, v, out, None, start, window, scale, pinned_tiles("sliding", tiles), sinks)
    global_forward(q, k, v, out, None, start, pack_global(hard), scale, pinned_tiles("global", tiles))
    return out


def causal_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, row_start: torch.Tensor,
                  tiles: dict | None = None) -> torch.Tensor:
    """Full causal attention within segments (each query over its segment's keys up to itself; -1 in
    ``row_start``: zero): the global kernel alone with every query packed, for the router's ``a_full``
    where dense SDPA would need a mask. Arguments as in ``aha_prefill_triton``."""
    q, k, v = strided(q, k, v)
    out = torch.empty_like(q)
    everyone = torch.ones(q.shape[:3], dtype=torch.bool, device=q.device)
    global_forward(q, k, v, out, None, segment_start(row_start, q.shape[2]), pack_global(everyone), scale,
                   pinned_tiles("global", tiles))
    return out


def sliding_forward(q, k, v, out, lse, start, window, scale, tiles: dict | None, sinks: int = 0) -> None:
    """The sliding-window kernel: writes every query's local output (its window and the first ``sinks`` keys
    of its segment) into ``out`` and, unless ``lse`` is None, its log-sum-exp (natural log of the scaled
    scores) into ``lse`` [b * h, n] fp32. ``start``: None or ``segment_start``'s tensor. ``tiles``: the
    launch setting, None to choose (``choose``)."""
    b, h, n, d = q.shape
    strides = (*q.stride()[:3], *k.stride()[:3], *out.stride()[:3])
    start, segments = segment_args(start, out)

    def launch(t: dict) -> None:
        _sliding_kernel[(triton.cdiv(n, t["BLOCK_M"]), b * h)](
            q, k, v, out, out if lse is None else lse, start, scale, b, n, h, h // k.shape[1], window, *strides, D=d,
            STORE_LSE=lse is not None, SEGMENTS=segments, SINKS=sinks, **tma_checked(t, k))

    launch(tiles or choose("sliding", q, k, launch))


def global_forward(q, k, v, out, lse, start, packed, scale, tiles: dict | None) -> None:
    """The global kernel over ``packed`` (from ``pack_global``): overwrites those rows of ``out`` (and of
    ``lse`` unless it is None) with full causal attention (within segments when ``start`` is given)."""
    b, h, n, d = q.shape
    strides = (*q.stride()[:3], *k.stride()[:3], *out.stride()[:3])
    start, segments = segment_args(start, out)

    def launch(t: dict) -> None:
        order, programs = work_order(*packed, t["BLOCK_M"])
        _global_kernel[(programs,)](
            q, k, v, out, out if lse is None else lse, *packed, packed[1] if order is None else order, start, scale, b,
            n, h, h // k.shape[1], *strides,
            D=d, STORE_LSE=lse is not None, SEGMENTS=segments, ORDERED=order is not None, **tma_checked(t, k))

    launch(tiles or choose("global", q, k, launch))
