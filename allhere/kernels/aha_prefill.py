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

Layout: q [b, h, n, d], k/v [b, kv_heads, n, d] (queries and keys over the same n positions), head dim
a power of two >= 16 (the op sends 16 to 128 here: at 256 the default tiles need more shared memory than
a GPU gives a block). Online softmax in fp32 (base 2), output in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import autotune
from .aha_pack import pack_global, work_order
from .tiles import default as default_tiles

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def edge_mask(rows, offs_n, first, rmask, N, W):
    """[rows, keys] of a tile that may be seen: causal, inside the window W, from each row's first key on,
    before the sequence end, real rows only."""
    diff = rows[:, None] - offs_n[None, :]
    return (diff >= 0) & (diff < W) & (offs_n[None, :] >= first[:, None]) & (offs_n[None, :] < N) & rmask[:, None]


@triton.jit
def inner_blocks(rows, first, rmask, N, W, lo, hi, BLOCK_N: tl.constexpr):
    """(inner_lo, inner_hi): the key blocks of [lo, hi) that every real row of ``rows`` sees entirely --
    inside the latest row's window, past every row's first key, up to the earliest row -- where no mask is
    needed (lo aligned to BLOCK_N, hi the end of the range)."""
    latest = tl.max(tl.where(rmask, rows, 0), 0)
    earliest = tl.min(tl.where(rmask, rows, N), 0)
    inner_lo = tl.maximum(tl.maximum(latest - W + 1, tl.max(tl.where(rmask, first, 0), 0)), 0)
    inner_lo = tl.minimum(tl.maximum(tl.cdiv(inner_lo, BLOCK_N) * BLOCK_N, lo), hi)
    return inner_lo, tl.maximum(((earliest + 1) // BLOCK_N) * BLOCK_N, inner_lo)


@triton.jit
def key_sources(K, V, B, HKV, N, skb, skh, skn, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """K and V as ``load_keys`` reads them: with TMA, tensor descriptors over [B, HKV, N, D] (the copy
    engine fetches a block of BLOCK_N keys and fills what lies past N with zeros); else the pointers."""
    if TMA:
        return (tl.make_tensor_descriptor(K, [B, HKV, N, D], [skb, skh, skn, 1], [1, 1, BLOCK_N, D]),
                tl.make_tensor_descriptor(V, [B, HKV, N, D], [skb, skh, skn, 1], [1, 1, BLOCK_N, D]))
    else:
        return K, V


@triton.jit
def load_keys(K, V, kbase, kb, kh, skn, start, N, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
              TMA: tl.constexpr):
    """(positions, k, v) of the key block at ``start`` of batch row ``kb``, kv head ``kh`` (``kbase``: their
    offset); MASKED: keys past the sequence end N load as zeros, else every key of the block must exist.
    With TMA, K and V are ``key_sources``' descriptors (past N: zeros either way)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if TMA:  # one return at the end: the compiler does not take a return inside a constexpr branch
        k = K.load([kb, kh, start, 0]).reshape(BLOCK_N, D)
        v = V.load([kb, kh, start, 0]).reshape(BLOCK_N, D)
    else:
        ptrs = kbase + offs_n[:, None] * skn + tl.arange(0, D)[None, :]
        if MASKED:
            k = tl.load(K + ptrs, mask=offs_n[:, None] < N, other=0.0)
            v = tl.load(V + ptrs, mask=offs_n[:, None] < N, other=0.0)
        else:
            k = tl.load(K + ptrs)
            v = tl.load(V + ptrs)
    return offs_n, k, v


@triton.jit
def online_step(m_i, l_i, acc, s, v, IEEE: tl.constexpr):
    """One key tile folded into the online softmax of a query tile: scores ``s`` [M, N] (base 2, masked keys
    -inf), values ``v`` [N, D]; returns the updated (max m, sum l, accumulator acc). IEEE: p @ v in full fp32
    (for fp32 values; a GPU's default for an fp32 ``tl.dot`` is TF32)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


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
def _attend_rows(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, hi, sm_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """Attention of ``rows`` over the key blocks [lo, hi), masked on the edges only (``inner_blocks``):
    (output [BLOCK_M, D] fp32, natural-log LSE; a row that saw nothing: 0, -inf)."""
    inner_lo, inner_hi = inner_blocks(rows, first, rmask, N, W, lo, hi, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale = sm_scale * LOG2E
    m_i, l_i, acc = _attend(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, lo, inner_lo, m_i, l_i, acc,
                            qk_scale, True, BLOCK_N, D, TMA)
    m_i, l_i, acc = _attend(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, inner_lo, inner_hi, m_i, l_i, acc,
                            qk_scale, False, BLOCK_N, D, TMA)
    m_i, l_i, acc = _attend(q, K, V, kbase, kb, kh, skn, rows, first, rmask, N, W, inner_hi, hi, m_i, l_i, acc,
                            qk_scale, True, BLOCK_N, D, TMA)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None], (m_i + tl.log2(l_safe)) * LN2


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
def row_starts(START, b, N, rows, rmask, SEGMENTS: tl.constexpr):
    """The first key each of ``rows`` may see: its segment's start (N: none at all) from START [b, N],
    or 0 when there are no segments."""
    if SEGMENTS:
        return tl.load(START + b * N + rows, mask=rmask, other=N)
    else:
        return tl.zeros_like(rows)


@triton.jit
def _sliding_kernel(Q, K, V, O, LSE, START, sm_scale, B, N, H, G, W,
                    sqb, sqh, sqn, skb, skh, skn, sob, soh, son,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, STORE_LSE: tl.constexpr,
                    SEGMENTS: tl.constexpr, TMA: tl.constexpr = False):
    bh, b, h, kh, offs_m, lo, hi = window_block(N, H, G, W, BLOCK_M, BLOCK_N)
    K, V = key_sources(K, V, B, H // G, N, skb, skh, skn, BLOCK_N, D, TMA)
    offs_d = tl.arange(0, D)
    rmask = offs_m < N
    first = row_starts(START, b, N, offs_m, rmask, SEGMENTS)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=rmask[:, None], other=0.0)
    out, lse = _attend_rows(q, K, V, b * skb + kh * skh, b.to(tl.int32), kh, skn, offs_m, first, rmask, N, W, lo,
                            hi, sm_scale, BLOCK_M, BLOCK_N, D, TMA)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None])
    if STORE_LSE:
        tl.store(LSE + bh * N + offs_m, lse, mask=rmask)


@triton.jit
def packed_block(ROWS, CUM, ORDER, B, N, H, G, BLOCK_M: tl.constexpr, ORDERED: tl.constexpr):
    """This program's block of global queries: the work item (batch * heads + head) * blocks per head + block
    of that head, ORDER[program id] where ORDERED (``aha_pack.longest_first``), else the fixed order (every
    head's last block, then the blocks before them, ...). Returns (rows in it -- 0 or less when the head has
    fewer blocks --, b * h + h, b, h, kv head, row mask, positions)."""
    per_head = tl.cdiv(N, BLOCK_M)
    if ORDERED:
        item = tl.load(ORDER + tl.program_id(0)).to(tl.int32)  # int64 indices of a sort: as int32
    else:
        bhs = B * H
        item = (tl.program_id(0) % bhs) * per_head + per_head - 1 - tl.program_id(0) // bhs
    bh = item // per_head
    blk = item % per_head
    count = tl.load(CUM + bh * N + N - 1) - blk * BLOCK_M
    b = (bh // H).to(tl.int64)  # 64-bit: b * stride may pass 2**31
    h = bh % H
    i = tl.arange(0, BLOCK_M)
    rmask = i < count
    pos = tl.load(ROWS + bh * (N + 1) + blk * BLOCK_M + i, mask=rmask, other=0)
    return count, bh, b, h, h // G, rmask, pos


@triton.jit
def packed_keys(START, b, N, pos, rmask, SEGMENTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys a packed block reads: (each row's first key, the first key block's start, the last key):
    from its earliest row's segment start (0 without segments) to its last row."""
    first = row_starts(START, b, N, pos, rmask, SEGMENTS)
    lo = (tl.min(tl.where(rmask, first, N), 0) // BLOCK_N) * BLOCK_N
    return first, lo, tl.max(tl.where(rmask, pos, 0), 0)


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
                       scale: float, tiles: dict | None = None, row_start: torch.Tensor | None = None) -> torch.Tensor:
    """AHA forward for queries and keys over the same positions; ``hard`` [b, h, n] bool (True = global).
    q, k, v are read where they lie (``strided``). tiles: None, each kernel's launch setting from
    ``allhere.kernels.autotune`` (tuned on the GPU, the default in the interpreter); or a setting pinned
    for both kernels (BLOCK_M: query rows per program and packed pairs per block, BLOCK_N: keys per step,
    num_warps, num_stages; what is left out comes from the default). row_start: optional int [b, n] from
    ``allhere.masks.segment_starts``: each query sees only the keys from its segment's start on (-1: none,
    zero output), all segments in the same launch."""
    q, k, v = strided(q, k, v)
    out = torch.empty_like(q)  # q's own layout where q is dense (a transposed projection stays one)
    start = segment_start(row_start, q.shape[2])
    sliding_forward(q, k, v, out, None, start, window, scale, pinned_tiles("sliding", tiles))
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


def strided(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the kernels read them: in place, any strides but a unit-stride last dimension (a view of
    a larger cache buffer, a transposed projection); k and v with one layout. Only what breaks that is
    copied: a last dimension with a stride, or k and v laid out differently."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def pinned_tiles(kernel: str, tiles: dict | None) -> dict | None:
    """None (the kernel chooses) or ``tiles`` completed from ``kernel``'s default setting."""
    return None if tiles is None else {**default_tiles(kernel), **tiles}


def choose(kernel: str, q: torch.Tensor, k: torch.Tensor, launch, *key: str) -> dict:
    """``kernel``'s launch setting for a call like (q, k) (``autotune.setting``): keyed on head dim, dtype,
    grouped-query group and the length bucket of the keys, plus ``key``."""
    d, n = q.shape[-1], k.shape[2]
    shape = (f"d{d}", str(q.dtype).removeprefix("torch."), f"g{q.shape[1] // k.shape[1]}",
             f"n{autotune.length_bucket(n)}", *key)
    return autotune.setting(kernel, shape, q.device, launch, d, q.element_size(), length=n)


def tma_checked(setting: dict, k: torch.Tensor) -> dict:
    """``setting``, its TMA (tensor descriptors for the keys and values) kept only where k and v allow it:
    base and strides in multiples of 16 bytes (else the pointer path, same tiles). Descriptors built in a
    kernel need scratch memory: Triton's allocator is set for this thread's context (autograd may run a
    backward on another thread, so at every launch that uses them)."""
    if not setting.get("TMA"):
        return setting
    elem = k.element_size()
    if k.data_ptr() % 16 or any(s * elem % 16 for s in k.stride()[:3]):
        return {**setting, "TMA": False}
    device = k.device
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    return setting


def segment_start(row_start: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The kernels' START [b, n] int32 from ``row_start`` (-1, sees nothing, becomes n)."""
    if row_start is None:
        return None
    return torch.where(row_start < 0, n, row_start).to(torch.int32).contiguous()


def segment_args(start: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(START, SEGMENTS) for a kernel call: without segments a placeholder pointer that is never read."""
    return (dummy, False) if start is None else (start, True)


def sliding_forward(q, k, v, out, lse, start, window, scale, tiles: dict | None) -> None:
    """The sliding-window kernel: writes every query's local output into ``out`` and, unless ``lse`` is
    None, its log-sum-exp (natural log of the scaled scores) into ``lse`` [b * h, n] fp32. ``start``:
    None or ``segment_start``'s tensor. ``tiles``: the launch setting, None to choose (``choose``)."""
    b, h, n, d = q.shape
    strides = (*q.stride()[:3], *k.stride()[:3], *out.stride()[:3])
    start, segments = segment_args(start, out)

    def launch(t: dict) -> None:
        _sliding_kernel[(triton.cdiv(n, t["BLOCK_M"]), b * h)](
            q, k, v, out, out if lse is None else lse, start, scale, b, n, h, h // k.shape[1], window, *strides, D=d,
            STORE_LSE=lse is not None, SEGMENTS=segments, **tma_checked(t, k))

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


def built_for_interpreter() -> bool:
    """Whether this module's kernels were built for Triton's interpreter (CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_sliding_kernel, InterpretedFunction)
