"""The building blocks the AHA kernels share (``aha_prefill``, ``aha_train``, ``aha_decode``, ``aha_paged``):
each rule written once, here, and called by every kernel that needs it.

- The key range of a query (the window rule): ``window_start`` (the first key a local query at position
  ``pos`` reads: its ``w`` most recent keys, itself included, ``pos - kv < w``), ``first_key`` (AHA's
  routing on top of it: a global query reads from key 0), ``last_reader`` (the other side of the same rule:
  the last query whose window holds a key), ``edge_mask`` (the rule as a mask of a [rows, keys] tile) and
  ``inner_blocks`` (the key blocks every row of a tile sees entirely, where no mask is needed).
- The sinks of a local query (attention sinks, "Efficient Streaming Language Models with Attention Sinks",
  arXiv:2309.17453): the first ``S`` keys of its segment, read besides its window. ``sink_end`` (where those
  its window does not hold end), ``sink_mask`` (as a mask of a [rows, keys] tile) and ``sink_blocks`` (the key
  blocks a tile of rows reads them from). A kernel folds them in with a short pass of their own before the
  window's, over (row, key) pairs disjoint from the window's, so that no key counts twice: per row they are one
  more key range [seg, end), which the kernel's masked key loop takes as rows whose last key is end - 1, with
  no window. With ``S`` = 0 (a constexpr) that pass is not compiled at all.
- The online softmax in base 2: ``online_step`` folds a key tile into a tile of query rows (``tl.dot``);
  ``decode_state`` / ``decode_step`` do the same for a single query (decode).
- The dense layout [b, heads, n, d] of the prefill and training kernels: the keys (``key_sources``,
  ``load_keys``: pointers or tensor descriptors) and the rows a program takes (``window_block``: a block of
  consecutive queries; ``packed_block`` / ``packed_keys``: a block of packed global queries; ``row_starts``:
  each row's segment start).
- The split-KV decode (flash decoding) of ``aha_decode`` and ``aha_paged``: ``split_keys`` (a program's
  share of its head's key range), ``finish_split`` and ``merge_splits`` (the last split to finish merges the
  partial outputs by their log-sum-exps), and on the host the scratch and arrival counters they need.
- Host helpers that prepare a launch: ``strided`` (q, k, v read where they lie), the launch setting
  (``pinned_tiles``, ``choose``, ``tma_checked``), segments (``segment_start``, ``segment_args``) and
  ``built_for_interpreter``.

Scores are kept in base 2 (``qk_scale`` = scale * LOG2E); log-sum-exps are returned in base 2 by the decode
splits and in natural log (times LN2) by the prefill kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import autotune
from .tiles import default as default_tiles

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# --- the key range of a query: the window rule ---


@triton.jit
def window_start(pos, W):
    """The first key a local query at position ``pos`` reads: the first of its W most recent keys, itself
    included (``pos - kv < W``), never before key 0."""
    return tl.maximum(pos - W + 1, 0)


@triton.jit
def first_key(pos, glob, W):
    """The first key a query at position ``pos`` reads under AHA's gate ``glob`` (True: global, the whole
    prefix from key 0; False: its window, ``window_start``). It reads the keys up to itself."""
    return tl.where(glob, 0, window_start(pos, W))


@triton.jit
def last_reader(key, W):
    """The last query position whose window of W keys holds ``key`` (``window_start`` seen from the key)."""
    return key + W - 1


@triton.jit
def edge_mask(rows, offs_n, first, rmask, N, W):
    """[rows, keys] of a tile that may be seen: causal, inside the window W (``pos - kv < W``), from each
    row's first key on, before the sequence end, real rows only."""
    diff = rows[:, None] - offs_n[None, :]
    return (diff >= 0) & (diff < W) & (offs_n[None, :] >= first[:, None]) & (offs_n[None, :] < N) & rmask[:, None]


@triton.jit
def inner_blocks(rows, first, rmask, N, W, lo, hi, BLOCK_N: tl.constexpr):
    """(inner_lo, inner_hi): the key blocks of [lo, hi) that every real row of ``rows`` sees entirely --
    inside the latest row's window, past every row's first key, up to the earliest row -- where no mask is
    needed (lo aligned to BLOCK_N, hi the end of the range)."""
    latest = tl.max(tl.where(rmask, rows, 0), 0)
    earliest = tl.min(tl.where(rmask, rows, N), 0)
    inner_lo = tl.maximum(window_start(latest, W), tl.max(tl.where(rmask, first, 0), 0))
    inner_lo = tl.minimum(tl.maximum(tl.cdiv(inner_lo, BLOCK_N) * BLOCK_N, lo), hi)
    return inner_lo, tl.maximum(((earliest + 1) // BLOCK_N) * BLOCK_N, inner_lo)


@triton.jit
def sink_end(seg, first, S):
    """One past the last sink a query reads outside its main key range: the first S keys of its segment (from
    ``seg``) that lie before ``first``, the range's first key (its window's; a global query's range starts at
    ``seg``). Its sinks outside the range are [seg, sink_end): none where sink_end <= seg."""
    return tl.minimum(seg + S, first)


@triton.jit
def sink_mask(offs_n, seg, end, rmask):
    """[rows, keys] of a tile that are sinks outside each row's window: seg <= key < end (``sink_end``), real
    rows only (end <= the row's position: causal and inside the sequence)."""
    return (offs_n[None, :] >= seg[:, None]) & (offs_n[None, :] < end[:, None]) & rmask[:, None]


@triton.jit
def sink_blocks(seg, end, rmask, N, BLOCK_N: tl.constexpr):
    """(lo, hi): the key blocks holding a sink outside the window of some real row (each row's [seg, end),
    ``sink_end``), lo aligned to BLOCK_N; empty (lo >= hi) where every row's window holds its sinks."""
    some = rmask & (end > seg)
    return (tl.min(tl.where(some, seg, N), 0) // BLOCK_N) * BLOCK_N, tl.max(tl.where(some, end, 0), 0)


# --- the online softmax (base 2) ---


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
def decode_state(BLOCK_N: tl.constexpr, D: tl.constexpr):
    """A single query's empty online softmax: (max -inf, sum 0: fp32 scalars a loop can carry, accumulator [D])."""
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    return m_i, l_i, tl.zeros([D], tl.float32)


@triton.jit
def decode_step(m_i, l_i, acc, q, k, v, kmask, qk_scale):
    """One key tile folded into a single query's online softmax: query ``q`` [D] fp32, keys ``k`` and values
    ``v`` [N, D] (taken in fp32), ``kmask`` [N] the keys that count, ``qk_scale`` = scale * log2 e; returns
    the updated (max, sum, accumulator [D])."""
    s = tl.where(kmask, tl.sum(k.to(tl.float32) * q[None, :], 1) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)


# --- the dense layout [b, heads, n, d] (prefill and training) ---


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
def window_block(N, H, G, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's query block (program ids: block, batch * heads + head): (b * h + h, b, h, kv head,
    row offsets, and the key range [lo, hi) its windows reach, lo aligned to BLOCK_N)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit: b * stride may pass 2**31
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = (window_start(pid_m * BLOCK_M, W) // BLOCK_N) * BLOCK_N
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


# --- split-KV decode: a head's keys split across programs, merged by the last one to finish ---


@triton.jit
def split_keys(first, last, split, nsplit, SPLIT: tl.constexpr):
    """Split ``split`` of ``nsplit`` of a head's key range [first, last), SPLIT keys each: (its keys [start,
    end) -- empty past the range --, how many splits have keys)."""
    start = first + split * SPLIT
    return start, tl.minimum(start + SPLIT, last), tl.minimum(tl.cdiv(last - first, SPLIT), nsplit)


@triton.jit
def merge_splits(OP, LSE, base, live, D: tl.constexpr, CHUNK: tl.constexpr):
    """(weighted sum [D], sum of the weights) of the partial outputs ``OP[base + s]`` [D] of the splits
    s < ``live``, each weighted by 2 ** (its log-sum-exp ``LSE[base + s]`` (base 2) - their max)."""
    offs_s = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D)
    m = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    for s0 in range(0, live, CHUNK):
        lse = tl.load(LSE + base + s0 + offs_s, mask=s0 + offs_s < live, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, 0))
    acc = tl.zeros([D], tl.float32)
    total = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    for s0 in range(0, live, CHUNK):
        smask = s0 + offs_s < live
        w = tl.exp2(tl.load(LSE + base + s0 + offs_s, mask=smask, other=float("-inf")) - m)
        part = tl.load(OP + (base + s0 + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
        total += tl.sum(w, 0)
    return acc, total


@triton.jit
def finish_split(acc, l_i, m_i, o, OP, LSE, ARRIVED, rh, split, nsplit, live, D: tl.constexpr,
                 CHUNK: tl.constexpr):
    """The end of a decode split of (sequence or request, head) ``rh`` (int64) whose output row is at ``o``
    [D]: the only split of its head writes the output; otherwise it writes its partial output and
    log-sum-exp, and the last of the head's ``live`` splits to arrive (counted in ARRIVED, which it sets
    back to 0) merges them (``merge_splits``)."""
    offs_d = tl.arange(0, D)
    if live == 1:  # l_i >= 1: the split has keys
        tl.store(o + offs_d, (acc / l_i).to(o.dtype.element_ty))
    else:
        at = rh * nsplit + split
        tl.store(OP + at * D + offs_d, acc / l_i)
        tl.store(LSE + at, m_i + tl.log2(l_i))
        tl.debug_barrier()  # every thread's stores, then one release (gpu scope) that carries them
        if tl.atomic_add(ARRIVED + rh, 1, sem="acq_rel") == live - 1:  # the last split: every partial is there
            acc, total = merge_splits(OP, LSE, rh * nsplit, live, D, CHUNK)
            tl.store(o + offs_d, (acc / total).to(o.dtype.element_ty))
            tl.store(ARRIVED + rh, 0)  # ready for the next call


MERGE_CHUNK = 16  # splits the merge reads at a time

_ARRIVED: dict[torch.device, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []


def arrived_counters(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 counter per (sequence, head), kept per device between calls (each call leaves it zero;
    calls on one stream at a time, as a model's layers make them). A larger one replaces it; the earlier ones
    are kept, since a captured CUDA graph may still use them."""
    have = _ARRIVED.get(device)
    if have is None or have.numel() < count:
        if autotune.capturing():
            raise RuntimeError(f"AHA decode: {count} (sequence, head) counters are needed while a CUDA graph is "
                               "captured; run one eager call of this batch size first")
        if have is not None:
            _KEPT.append(have)
        have = _ARRIVED[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return have


def split_scratch(rows: int, keys: int, split: int, d: int,
                  device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(nsplit, partial outputs [rows * nsplit * d], log-sum-exps [rows * nsplit]) for ``rows`` heads of up to
    ``keys`` keys split ``split`` at a time: the splits' fp32 scratch, in one allocation."""
    nsplit = triton.cdiv(keys, split)
    scratch = torch.empty(rows * nsplit * (d + 1), device=device, dtype=torch.float32)
    return nsplit, scratch[:rows * nsplit * d], scratch[rows * nsplit * d:]


# --- host helpers of a launch ---


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


def built_for_interpreter() -> bool:
    """Whether the kernels were built for Triton's interpreter (CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(online_step, InterpretedFunction)
