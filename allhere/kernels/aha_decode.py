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

Sinks (``sinks`` = S > 0): a local head also reads the first S keys of its sequence (from ``kv_start``); its
first split folds the ones before its window (``aha_common.sink_end``) in before its share of the window, so the
splits and the grid stay as they are. S is a constexpr: S = 0 compiles the kernel without them.

With ``kv_len`` on the device the launch does not depend on the lengths at all (the grid follows the
buffer's t, the splits past a sequence's length return at once): one launch setting serves every step of
a growing cache, as a captured CUDA graph replays it.

The key range (``aha_common.first_key``), the split (``aha_common.split_keys``), the single-query online softmax and
the merge (``aha_common.finish_split``) are ``aha_common``', shared with the paged decode (``aha_paged``); this file
holds the kernel over a dense cache and its launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import autotune
from .aha_common import (
    LOG2E,
    MERGE_CHUNK,
    arrived_counters,
    choose,
    decode_state,
    decode_step,
    finish_split,
    first_key,
    pinned_tiles,
    sink_end,
    split_keys,
    split_scratch,
    strided,
)


@triton.jit
def _fold_keys(m_i, l_i, acc, q, K, V, kbase, skn, lo, end, qk_scale, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """The keys [lo, end) of one sequence's kv head (``kbase``: their offset) folded into the query's online
    softmax: the updated (max, sum, accumulator)."""
    offs_d = tl.arange(0, D)
    for s0 in range(lo, end, BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        kmask = offs_n < end
        kv = kbase + offs_n[:, None] * skn + offs_d[None, :]
        k = tl.load(K + kv, mask=kmask[:, None], other=0.0)
        v = tl.load(V + kv, mask=kmask[:, None], other=0.0)
        m_i, l_i, acc = decode_step(m_i, l_i, acc, q, k, v, kmask, qk_scale)
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(Q, K, V, GATE, KV_START, KV_LEN, OP, LSE, O, ARRIVED, sm_scale, T, H, G, W,
                   sqb, sqh, skb, skh, skn,
                   SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, HAS_START: tl.constexpr,
                   HAS_LEN: tl.constexpr, CHUNK: tl.constexpr, SINKS: tl.constexpr = 0):
    """One split of one (sequence, head) (program ids: (sequence x head, split)); ``finish_split`` writes or
    merges. A head with no key at all gets zero from its first split. T: the buffer's length, or with
    HAS_LEN each sequence's own from KV_LEN. The first split also reads the SINKS first keys of the
    sequence that lie before the head's range (a local head's)."""
    bh = tl.program_id(0).to(tl.int64)  # 64-bit: bh * nsplit * D may pass 2**31
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    b = bh // H
    h = bh % H
    kh = h // G
    if HAS_LEN:
        T = tl.minimum(tl.load(KV_LEN + b), T)
    first = first_key(T - 1, tl.load(GATE + bh) != 0, W)  # the query is the sequence's last position
    seg = 0
    if HAS_START:
        seg = tl.load(KV_START + b)
        first = tl.maximum(first, seg)  # keys before it are padding
    start, end, live = split_keys(first, T, split, nsplit, SPLIT)  # live: the splits with keys
    offs_d = tl.arange(0, D)
    if start >= end:  # past this head's keys
        if (split == 0) & (live <= 0):  # no key at all
            tl.store(O + bh * D + offs_d, tl.zeros([D], tl.float32).to(O.dtype.element_ty))
        return
    q = tl.load(Q + b * sqb + h * sqh + offs_d).to(tl.float32)
    qk_scale = sm_scale * LOG2E
    m_i, l_i, acc = decode_state(BLOCK_N, D)
    kbase = b * skb + kh * skh
    if SINKS > 0:  # the first split's: the sinks before the head's range (none for a global head)
        sinks_end = tl.where(split == 0, sink_end(seg, first, SINKS), seg)
        m_i, l_i, acc = _fold_keys(m_i, l_i, acc, q, K, V, kbase, skn, seg, sinks_end, qk_scale, BLOCK_N, D)
    m_i, l_i, acc = _fold_keys(m_i, l_i, acc, q, K, V, kbase, skn, start, end, qk_scale, BLOCK_N, D)
    finish_split(acc, l_i, m_i, O + bh * D, OP, LSE, ARRIVED, bh, split, nsplit, live, D, CHUNK)


def aha_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                      scale: float, tiles: dict | None = None, kv_start: torch.Tensor | None = None,
                      kv_len: torch.Tensor | None = None, sinks: int = 0) -> torch.Tensor:
    """AHA attention of the last query of every (sequence, head) over the whole cache; returns [b, h, 1, d].
    k, v are read where they lie: a view of a larger cache buffer costs no copy (``strided``). tiles: None,
    the launch setting from ``allhere.kernels.autotune``; or a pinned one (SPLIT: keys per program, the
    cache being split across programs; BLOCK_N: keys per step; num_warps, num_stages; what is left out
    comes from the default). kv_start: optional int [b], keys before it are padding (a sequence with no
    real key gets zero). kv_len: optional int [b] on q's device, each sequence's keys (its query the last of
    them; k's length, the buffer's capacity, where larger; none: zero output): the launch is the same
    whatever the lengths, so a CUDA graph captured once replays every later step. sinks: a local head also
    reads the first ``sinks`` keys of its sequence (from ``kv_start``)."""
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
        nsplit, partial, lse = split_scratch(b * h, t, s["SPLIT"], d, q.device)
        _decode_kernel[(b * h, nsplit)](q, k, v, g, first, lens, partial, lse, out, arrived, scale, t, h,
                                        h // hkv, window, q.stride(0), q.stride(1), *k.stride()[:3], D=d,
                                        HAS_START=kv_start is not None, HAS_LEN=kv_len is not None,
                                        CHUNK=MERGE_CHUNK, SINKS=sinks, **s)

    if tiles is not None:
        launch(pinned_tiles("decode", tiles))
    elif kv_len is None:  # keyed also on the batch x heads bucket: with the length it sets how many programs run
        launch(choose("decode", q, k, launch, f"bh{autotune.length_bucket(b * h)}"))
    else:  # a class of its own, timed with the buffer full (the setting serves every length a graph replays)
        full = lambda s: launch(s, torch.full_like(lens, t))  # noqa: E731
        launch(choose("decode", q, k, full, f"bh{autotune.length_bucket(b * h)}", "lens"))
    return out
