"""AHA decode in Triton: one new query per sequence and head; a local head reads only the last w cached
keys, a global head the whole cache. The key range is split across programs (split-KV, as in flash
decoding) so that a long cache of a global head is read by many thread blocks at once; a local head's
range fits in its first split (``cdiv(w, split)`` splits when w is larger) and its other programs return
at once without writing anything. A head whose keys fit in one split writes its output directly; the
splits of a longer range write their partial outputs and log-sum-exps, and the last of them to finish
(an atomic count per (sequence, head)) merges them by their weights. One launch per call: a decode step's
time at long contexts is mostly its host's, and a second launch for the merge cost about as much as the
kernels' own work at 32k (0.1 ms per call on an H200).

Layout: q [b, h, 1, d], k/v [b, kv_heads, t, d] (the cache, every sequence t long, or sequence i
``kv_len[i]`` long in a buffer of t; any strides but a unit-stride last dimension), gate [b, h] bool.

With ``kv_len`` on the device the launch does not depend on the lengths at all (the grid follows the
buffer's t, the splits past a sequence's length return at once): one launch setting serves every step of
a growing cache, as a captured CUDA graph replays it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import autotune
from .aha_prefill import LOG2E, choose, strided
from .tiles import default as default_tiles


@triton.jit
def _first_key(GATE, KV_START, bh, b, T, W, HAS_START: tl.constexpr):
    """The first key (sequence, head) ``bh`` of a sequence of T keys reads: 0 for a global head, T - W for a
    local one, never before the sequence's first real key."""
    lo = tl.where(tl.load(GATE + bh) != 0, 0, tl.maximum(T - W, 0))
    if HAS_START:
        lo = tl.maximum(lo, tl.load(KV_START + b))  # keys before it are padding
    return lo


@triton.jit
def decode_step(m_i, l_i, acc, s, v):
    """One key tile folded into a single query's online softmax: scores ``s`` [N] (base 2, masked keys -inf),
    values ``v`` [N, D] fp32; returns the updated (max, sum, accumulator [D])."""
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


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


@triton.jit
def _decode_kernel(Q, K, V, GATE, KV_START, KV_LEN, OP, LSE, O, ARRIVED, sm_scale, T, H, G, W,
                   sqb, sqh, skb, skh, skn,
                   SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, HAS_START: tl.constexpr,
                   HAS_LEN: tl.constexpr, CHUNK: tl.constexpr):
    """One split of one (sequence, head) (program ids: (sequence x head, split)); ``finish_split`` writes or
    merges. A head with no key at all gets zero from its first split. T: the buffer's length, or with
    HAS_LEN each sequence's own from KV_LEN."""
    bh = tl.program_id(0).to(tl.int64)  # 64-bit: bh * nsplit * D may pass 2**31
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    b = bh // H
    h = bh % H
    kh = h // G
    if HAS_LEN:
        T = tl.minimum(tl.load(KV_LEN + b), T)
    first = _first_key(GATE, KV_START, bh, b, T, W, HAS_START)
    live = tl.minimum(tl.cdiv(T - first, SPLIT), nsplit)  # splits with keys
    start = first + split * SPLIT
    end = tl.minimum(start + SPLIT, T)
    offs_d = tl.arange(0, D)
    if start >= end:  # past this head's keys
        if (split == 0) & (live <= 0):  # no key at all
            tl.store(O + bh * D + offs_d, tl.zeros([D], tl.float32).to(O.dtype.element_ty))
        return
    q = tl.load(Q + b * sqb + h * sqh + offs_d).to(tl.float32)
    qk_scale = sm_scale * LOG2E
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)  # fp32 scalars carried by the loop
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(start, end, BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        kmask = offs_n < end
        kv = b * skb + kh * skh + offs_n[:, None] * skn + offs_d[None, :]
        k = tl.load(K + kv, mask=kmask[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + kv, mask=kmask[:, None], other=0.0).to(tl.float32)
        s = tl.where(kmask, tl.sum(k * q[None, :], 1) * qk_scale, float("-inf"))
        m_i, l_i, acc = decode_step(m_i, l_i, acc, s, v)
    finish_split(acc, l_i, m_i, O + bh * D, OP, LSE, ARRIVED, bh, split, nsplit, live, D, CHUNK)


MERGE_CHUNK = 16  # splits the merge reads at a time


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


def split_scratch(rows: int, nsplit: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial outputs [rows * nsplit * d] and log-sum-exps [rows * nsplit], fp32, in one allocation."""
    scratch = torch.empty(rows * nsplit * (d + 1), device=device, dtype=torch.float32)
    return scratch[:rows * nsplit * d], scratch[rows * nsplit * d:]


_ARRIVED: dict[torch.device, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []


def aha_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                      scale: float, tiles: dict | None = None, kv_start: torch.Tensor | None = None,
                      kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """AHA attention of the last query of every (sequence, head) over the whole cache; returns [b, h, 1, d].
    k, v are read where they lie: a view of a larger cache buffer costs no copy (``strided``). tiles: None,
    the launch setting from ``allhere.kernels.autotune``; or a pinned one (SPLIT: keys per program, the
    cache being split across programs; BLOCK_N: keys per step; num_warps, num_stages; what is left out
    comes from the default). kv_start: optional int [b], keys before it are padding (a sequence with no
    real key gets zero). kv_len: optional int [b] on q's device, each sequence's keys (its query the last of
    them; k's length, the buffer's capacity, where larger; none: zero output): the launch is the same
    whatever the lengths, so a CUDA graph captured once replays every later step."""
    b, h, lq, d = q.shape
    if lq != 1:
        raise ValueError(f"the decode kernel takes one query per sequence, got {lq}")
    q, k, v = strided(q, k, v)
    hkv, t = k.shape[1], k.shape[2]
    g = gate.reshape(b * h).contiguous()  # read as != 0: a bool gate's bytes as they lie (no conversion kernel)
    g = g.view(torch.uint8) if g.dtype == torch.bool else g
    first, lens = (g if x is None else x.to(torch.int32).contiguous() for x in (kv_start, kv_len))  # None: placeholders
    out = torch.empty(b, h, 1, d, device=q.device, dtype=q.dtype)
    if t == 0:  # no key at all
        return out.zero_()
    arrived = arrived_counters(q.device, b * h)

    def launch(s: dict, lens: torch.Tensor = lens) -> None:
        nsplit = triton.cdiv(t, s["SPLIT"])
        partial, lse = split_scratch(b * h, nsplit, d, q.device)
        _decode_kernel[(b * h, nsplit)](q, k, v, g, first, lens, partial, lse, out, arrived, scale, t, h,
                                        h // hkv, window, q.stride(0), q.stride(1), *k.stride()[:3], D=d,
                                        HAS_START=kv_start is not None, HAS_LEN=kv_len is not None,
                                        CHUNK=MERGE_CHUNK, **s)

    if tiles is not None:
        launch({**default_tiles("decode"), **tiles})
    elif kv_len is None:  # keyed also on the batch x heads bucket: with the length it sets how many programs run
        launch(choose("decode", q, k, launch, f"bh{autotune.length_bucket(b * h)}"))
    else:  # a class of its own, timed with the buffer full (the setting serves every length a graph replays)
        full = lambda s: launch(s, torch.full_like(lens, t))  # noqa: E731
        launch(choose("decode", q, k, full, f"bh{autotune.length_bucket(b * h)}", "lens"))
    return out
