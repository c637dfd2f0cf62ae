"""AHA attention over a paged KV cache in Triton, as a server (vLLM) keeps it: many requests in one call,
each with its own length, its keys scattered over fixed-size blocks that a block table names.

A call carries a batch of requests laid end to end on the token axis: request r's queries are the rows
``query_start[r]:query_start[r + 1]`` of q, the last positions of its ``seq_lens[r]`` tokens (one row: a
decode step; several: a chunk of a prefill, after the context already cached). Every (query, head) has a
hard gate: global reads every key up to its position, local only the ``window`` most recent ones (its own
included). Two kernels share the call, the requests split between them on the GPU with nothing read
back (the grids come from the shapes alone, so a call can be captured in a CUDA graph):

- decode (requests with one query), as ``aha_decode`` and from the same pieces (``aha_common``): the keys of
  every (request, head) are split across programs, SPLIT keys each (flash decoding), so that a long global
  head is read by many thread blocks at once; a local head's window fits in its first split(s) and its
  other programs return at once. A head whose keys fit one split writes its output; the splits of a
  longer one are merged by their log-sum-exp by the last of them to finish, reading only the splits that
  had keys.
- prefill (requests with several queries), grown from ``aha_prefill`` (the window rule, edge masks and online
  softmax of ``aha_common``), in two passes of one kernel whose program is a tile of BLOCK_M queries of one
  (request, head) sharing the keys they read through ``tl.dot``. The window pass: consecutive queries, every
  one over its window (the tile visits only the blocks its windows cover, about BLOCK_M + window keys, never
  the prefix). The global pass: the head's global queries of the request packed in order
  (``aha_pack.pack_global``, on the device), every one over its whole prefix, written over its window result
  (the wasted window work is a fraction mu of the local work). A tile mixing both kinds would read the whole
  prefix for its local rows too, and at a few percent of global (query, head) pairs nearly every tile of 64
  has one; packed, only cdiv(global queries, BLOCK_M) tiles per (request, head) read the prefix. In both
  passes the keys every row of the tile sees run without mask work (``inner_blocks``). Tiles are numbered
  without a host sync as in vLLM's unified attention: request r owns the tile numbers from (its pass's rows
  before it) // BLOCK_M + r on (at least as many as it needs), and a program finds its request by a binary
  search over those starts.

Sinks (``sinks`` = S > 0, AHA's local branch with attention sinks): a local query also reads the request's
first S keys (its positions 0 .. S - 1: each request is its own sequence). Both kernels fold the ones outside a
row's window in before the window (``aha_common.sink_end``): the decode in its first split, the window pass in a
pass over the sink blocks of the tile (``aha_common.sink_blocks``); the grids do not change. S is a constexpr:
S = 0 compiles the kernels without them.

Keys are gathered through the block table one key at a time (block ``block_table[r, p // BLOCK_SIZE]``,
slot ``p % BLOCK_SIZE``), so a key tile need not match the cache's block size. Only table entries of keys
before ``seq_lens[r]`` are read: what lies past a request's blocks is never looked at.

Layout (vLLM's FlashAttention layout): q, out [tokens, heads, d]; k_cache, v_cache [num_blocks,
block_size, kv_heads, d], e.g. ``kv_cache[0]`` and ``kv_cache[1]`` of one [2, num_blocks, block_size,
kv_heads, d] tensor (any strides, a unit-stride last dimension: read where they lie); block_table [reqs,
max_blocks], query_start [reqs + 1], seq_lens [reqs] int32; gate [tokens, heads] bool (True = global);
grouped-query attention: query head h reads kv head h // (heads // kv_heads). Head dim a power of two
from 16 to 128 (``refusal``); any block size. Online softmax in fp32 (base 2), output in out's dtype.

Launch settings: the paged kernels take the candidate lists of the kernels they grew from (``tiles``:
"decode" for SPLIT / BLOCK_N, "sliding" and "global" for the two prefill passes' BLOCK_M / BLOCK_N;
without tensor descriptors, which a gather cannot use), tuned on the GPU by ``autotune`` under keys of
their own ("paged", the block size), the default under Triton's interpreter, and pinned with the others by
``autotune.pinned()``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import autotune
from .aha_common import (
    LOG2E,
    MERGE_CHUNK,
    arrived_counters,
    decode_state,
    decode_step,
    edge_mask,
    finish_split,
    first_key,
    inner_blocks,
    online_step,
    pinned_tiles,
    sink_blocks,
    sink_end,
    split_keys,
    split_scratch,
    strided,
)
from .aha_pack import pack_global

DECODE = "decode"  # the candidate lists (``tiles.SPACES``) the paged decode kernel is tuned over,
WINDOW = "sliding"  # the prefill's window pass (every query over its window)
GLOBAL = "global"  # and its global pass (the packed global queries over their prefixes)


@triton.jit
def _paged_keys(K, V, BT, bt_row, kv_off, offs_n, end, skb, sks,
                MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """(k, v) [BLOCK_N, D] of the key positions ``offs_n`` of one request (``bt_row``: its block-table row,
    ``kv_off``: the kv head's offset in a slot). MASKED: positions at or past ``end`` load as zeros and
    their table entries are not read; else every position must be a key of the request."""
    offs_d = tl.arange(0, D)
    if MASKED:
        inside = offs_n < end
        blk = tl.load(BT + bt_row + offs_n // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        ptrs = blk[:, None] * skb + (offs_n % BLOCK_SIZE)[:, None] * sks + kv_off + offs_d[None, :]
        k = tl.load(K + ptrs, mask=inside[:, None], other=0.0)
        v = tl.load(V + ptrs, mask=inside[:, None], other=0.0)
    else:
        blk = tl.load(BT + bt_row + offs_n // BLOCK_SIZE).to(tl.int64)  # 64-bit: block * stride may pass 2**31
        ptrs = blk[:, None] * skb + (offs_n % BLOCK_SIZE)[:, None] * sks + kv_off + offs_d[None, :]
        k = tl.load(K + ptrs)
        v = tl.load(V + ptrs)
    return k, v


@triton.jit
def _rows_before(QSTART, CUM, r, h, sch, GLOBAL: tl.constexpr):
    """How many of a pass's rows of head h lie before request r: its first query row (the window pass), or
    the global rows of head h before that row (the global pass; CUM [heads, tokens], row stride ``sch``: the
    running counts of ``aha_pack.pack_global``, none before row 0)."""
    row = tl.load(QSTART + r)
    if GLOBAL:
        row = tl.load(CUM + h * sch + row - 1, mask=row > 0, other=0)
    return row


@triton.jit
def _request_of_tile(QSTART, CUM, R, h, sch, BLOCK_M: tl.constexpr, GLOBAL: tl.constexpr):
    """(request, index of its tile's first row among the pass's rows) of this program: request r owns the
    tile numbers [before(r) // BLOCK_M + r, before(r + 1) // BLOCK_M + r + 1) (``_rows_before``) -- at least
    the cdiv(rows, BLOCK_M) it needs, R more than the rows' tiles in all --, found by a binary search over
    those starts. The index may lie past the request's rows (a tile it does not need)."""
    pid = tl.program_id(0)
    lo = 0
    hi = R
    while lo < hi:  # the first request whose tiles start after pid
        mid = (lo + hi) // 2
        if _rows_before(QSTART, CUM, mid, h, sch, GLOBAL) // BLOCK_M + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    r = lo - 1
    before = _rows_before(QSTART, CUM, r, h, sch, GLOBAL)
    return r, before + (pid - (before // BLOCK_M + r)) * BLOCK_M


@triton.jit
def _attend_paged(q, K, V, BT, bt_row, kv_off, skb, sks, pos, first, rmask, n, lo, hi, m_i, l_i, acc, qk_scale,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                  IEEE: tl.constexpr):
    """The key blocks [lo, hi) of an online softmax in base 2 for query positions ``pos`` (each row sees the
    keys from ``first`` to itself): the updated (m, l, acc). MASKED applies the rows' ranges, the request's
    end n and the row mask; without it every key of the range must be seen by every row. IEEE: full fp32
    dots (fp32 caches)."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k, v = _paged_keys(K, V, BT, bt_row, kv_off, offs_n, n, skb, sks, MASKED, BLOCK_SIZE, D)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:  # the window lives in ``first``: an unbounded width (n + 1) leaves edge_mask the rest
            s = tl.where(edge_mask(pos, offs_n, first, rmask, n, n + 1), s, float("-inf"))
        m_i, l_i, acc = online_step(m_i, l_i, acc, s, v, IEEE)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(Q, K, V, BT, QSTART, SEQLEN, CUM, PACKED, O, sm_scale, R, sch, G, W,
                    sqt, sqh, skb, sks, skh, sbt, sph, sot, soh,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                    GLOBAL: tl.constexpr, IEEE: tl.constexpr, SINKS: tl.constexpr = 0):
    """One tile of BLOCK_M rows of a request with several queries, one head (program ids: tile, head). The
    window pass (GLOBAL false): consecutive query rows, each over its window and the request's first SINKS
    keys. The global pass: the next BLOCK_M of the head's global rows of the request (PACKED [heads, tokens]:
    each head's global rows in order), each over its whole prefix, written over the window pass's result."""
    h = tl.program_id(1)
    r, i0 = _request_of_tile(QSTART, CUM, R, h, sch, BLOCK_M, GLOBAL)
    qs = tl.load(QSTART + r)
    qe = tl.load(QSTART + r + 1)
    count = _rows_before(QSTART, CUM, r + 1, h, sch, GLOBAL)
    if (qe - qs <= 1) | (i0 >= count):  # a decode request (the decode kernel's), or a tile it does not need
        return
    n = tl.load(SEQLEN + r)
    idx = i0 + tl.arange(0, BLOCK_M)
    rmask = idx < count
    if GLOBAL:
        rows = tl.load(PACKED + h * sph + idx, mask=rmask, other=qs).to(tl.int64)
    else:
        rows = idx.to(tl.int64)  # 64-bit: row * stride may pass 2**31
    pos = (n - qe + rows).to(tl.int32)  # the queries are the request's last positions
    first = first_key(pos, GLOBAL, W)
    lo = (tl.min(tl.where(rmask, first, n), 0) // BLOCK_N) * BLOCK_N  # window pass: the windows' blocks only
    hi = tl.max(tl.where(rmask, pos, 0), 0) + 1
    offs_d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * sqt + h * sqh + offs_d[None, :], mask=rmask[:, None], other=0.0)
    bt_row = r.to(tl.int64) * sbt
    kv_off = (h // G) * skh
    inner_lo, inner_hi = inner_blocks(pos, first, rmask, n, n + 1, lo, hi, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale = sm_scale * LOG2E
    if not GLOBAL:
        if SINKS > 0:  # the sinks before each row's window: per row the keys [0, end), a range (as in
            # ``aha_prefill._attend_sinks``) whose keys all lie before s_hi: nothing past it is gathered
            seg = tl.zeros_like(pos)
            end = sink_end(seg, first, SINKS)
            s_lo, s_hi = sink_blocks(seg, end, rmask, n, BLOCK_N)
            m_i, l_i, acc = _attend_paged(q, K, V, BT, bt_row, kv_off, skb, sks, end - 1, seg, rmask, s_hi, s_lo,
                                          s_hi, m_i, l_i, acc, qk_scale, True, BLOCK_N, BLOCK_SIZE, D, IEEE)
    m_i, l_i, acc = _attend_paged(q, K, V, BT, bt_row, kv_off, skb, sks, pos, first, rmask, n, lo, inner_lo,
                                  m_i, l_i, acc, qk_scale, True, BLOCK_N, BLOCK_SIZE, D, IEEE)
    m_i, l_i, acc = _attend_paged(q, K, V, BT, bt_row, kv_off, skb, sks, pos, first, rmask, n, inner_lo, inner_hi,
                                  m_i, l_i, acc, qk_scale, False, BLOCK_N, BLOCK_SIZE, D, IEEE)
    m_i, l_i, acc = _attend_paged(q, K, V, BT, bt_row, kv_off, skb, sks, pos, first, rmask, n, inner_hi, hi,
                                  m_i, l_i, acc, qk_scale, True, BLOCK_N, BLOCK_SIZE, D, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a real row sees at least itself
    tl.store(O + rows[:, None] * sot + h * soh + offs_d[None, :], out.to(O.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _decode_range(QSTART, SEQLEN, GATE, r, h, W, sgt):
    """(query row, whether the request is a decode step, its first key, its end) of (request r, head h):
    a global head reads from key 0, a local one the last W keys (and its sinks: ``aha_common.sink_end``)."""
    qs = tl.load(QSTART + r)
    one = tl.load(QSTART + r + 1) - qs == 1
    n = tl.load(SEQLEN + r)
    glob = tl.load(GATE + qs.to(tl.int64) * sgt + h, mask=one, other=0) != 0
    return qs.to(tl.int64), one, first_key(n - 1, glob, W), n  # the query is the request's last position


@triton.jit
def _fold_keys(m_i, l_i, acc, q, K, V, BT, bt_row, kv_off, skb, sks, lo, end, qk_scale,
               BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """The keys [lo, end) of one request's kv head folded into its decode query's online softmax: the updated
    (max, sum, accumulator)."""
    for s0 in range(lo, end, BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        k, v = _paged_keys(K, V, BT, bt_row, kv_off, offs_n, end, skb, sks, True, BLOCK_SIZE, D)
        m_i, l_i, acc = decode_step(m_i, l_i, acc, q, k, v, offs_n < end, qk_scale)
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(Q, K, V, BT, QSTART, SEQLEN, GATE, OP, LSE, O, ARRIVED, sm_scale, H, G, W,
                   sqt, sqh, skb, sks, skh, sbt, sgt, sot, soh,
                   SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                   CHUNK: tl.constexpr, SINKS: tl.constexpr = 0):
    """Split ``split`` (SPLIT keys) of one (request, head) of a decode request (program ids: request *
    heads + head, split), as ``aha_decode._decode_kernel``: a head whose keys fit one split writes its
    output; otherwise the splits write partial outputs and log-sum-exps (base 2), and the last to finish
    (``finish_split``) merges them. The first split also reads the request's first SINKS keys that lie
    before the head's range."""
    rh = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    r = rh // H
    h = rh % H
    row, one, lo, n = _decode_range(QSTART, SEQLEN, GATE, r, h, W, sgt)
    start, end, live = split_keys(lo, n, split, nsplit, SPLIT)  # live >= 1 splits: a decode row sees its own key
    if (one == 0) | (start >= end):  # not a decode request, or past this head's keys
        return
    offs_d = tl.arange(0, D)
    q = tl.load(Q + row * sqt + h * sqh + offs_d).to(tl.float32)
    bt_row = r.to(tl.int64) * sbt
    kv_off = (h // G) * skh
    qk_scale = sm_scale * LOG2E
    m_i, l_i, acc = decode_state(BLOCK_N, D)
    if SINKS > 0:  # the first split's: the sinks before the head's range (none for a global head)
        sinks_end = tl.where(split == 0, sink_end(0, lo, SINKS), 0)
        m_i, l_i, acc = _fold_keys(m_i, l_i, acc, q, K, V, BT, bt_row, kv_off, skb, sks, 0, sinks_end, qk_scale,
                                   BLOCK_N, BLOCK_SIZE, D)
    m_i, l_i, acc = _fold_keys(m_i, l_i, acc, q, K, V, BT, bt_row, kv_off, skb, sks, start, end, qk_scale, BLOCK_N,
                               BLOCK_SIZE, D)
    finish_split(acc, l_i, m_i, O + row * sot + h * soh, OP, LSE, ARRIVED, rh.to(tl.int64), split, nsplit, live,
                 D, CHUNK)


def paged_aha_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        query_start: torch.Tensor, seq_lens: torch.Tensor, gate: torch.Tensor, window: int,
                        scale: float, out: torch.Tensor, max_seq_len: int | None = None,
                        max_query_len: int | None = None, tiles: dict | None = None, sinks: int = 0) -> torch.Tensor:
    """AHA attention of a batch of requests over a paged KV cache (layout and design in the module
    docstring); writes ``out`` [tokens, heads, d] for the rows before ``query_start[-1]`` (the rows after it,
    padding, are left as they are) and returns it. The step's own keys must already be in the cache.

    Host hints (ints a server knows without asking the GPU; nothing here reads a tensor back):
    max_seq_len: at least every ``seq_lens[r]``, sets how many splits a decode head has room for (None: the
    block table's width times the block size, which may over-allocate the splits' scratch); max_query_len:
    at least every request's query count (1: a pure decode step, the prefill kernel is not launched).
    tiles: None, each kernel's launch setting from ``allhere.kernels.autotune``; or one setting pinned for
    all three (SPLIT: keys per decode program; BLOCK_M: query rows per prefill tile; BLOCK_N: keys per step;
    num_warps, num_stages; what is left out comes from each kernel's default). sinks: a local query also reads
    the first ``sinks`` keys of its request (AHA's local branch with attention sinks; not the learned sink
    logits of ``refusal``)."""
    tokens, heads, d, kv_heads, block_size = _check(q, k_cache, v_cache, block_table, query_start, seq_lens, gate,
                                                    window, out, sinks)
    reqs = block_table.shape[0]
    if tokens == 0 or reqs == 0:
        return out
    q, k_cache, v_cache = strided(q, k_cache, v_cache)
    table, starts, lens = (t.to(torch.int32).contiguous() for t in (block_table, query_start, seq_lens))
    g = gate.to(torch.int8).contiguous()
    bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
    group = heads // kv_heads
    cache = (q, k_cache, v_cache, table, starts, lens)
    q_k = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table.stride(0))
    key = (f"d{d}", str(q.dtype).removeprefix("torch."), f"g{group}", f"n{autotune.length_bucket(bound)}", "paged",
           f"bs{block_size}")

    arrived = arrived_counters(q.device, reqs * heads)

    def decode(s: dict) -> None:
        nsplit, partial, lse = split_scratch(reqs * heads, max(bound, 1), s["SPLIT"], d, q.device)
        _decode_kernel[(reqs * heads, nsplit)](*cache, g, partial, lse, out, arrived, scale, heads, group, window,
                                               *q_k, g.stride(0), out.stride(0), out.stride(1),
                                               BLOCK_SIZE=block_size, D=d, CHUNK=MERGE_CHUNK, SINKS=sinks,
                                               **_only(s, "SPLIT"))

    decode(_setting(DECODE, tiles, key + (f"bh{autotune.length_bucket(reqs * heads)}",), q, decode, bound))
    if max_query_len is not None and max_query_len <= 1:  # a pure decode step
        return out

    def prefill(s: dict, pass_: str, cum: torch.Tensor, rows: torch.Tensor) -> None:
        _prefill_kernel[(tokens // s["BLOCK_M"] + reqs, heads)](
            *cache, cum, rows, out, scale, reqs, cum.stride(0), group, window, *q_k, rows.stride(0), out.stride(0),
            out.stride(1), BLOCK_SIZE=block_size, D=d, GLOBAL=pass_ == GLOBAL, SINKS=sinks, **_only(s, "BLOCK_M"),
            IEEE=q.dtype == torch.float32)  # fp32 caches: fp32 dots (TF32, a GPU's default, is ~1e-3 off)

    longest = tokens if max_query_len is None else min(max_query_len, tokens)
    # In this order: the global pass overwrites its rows' window results. The window pass reads neither
    # cum nor rows (placeholders).
    for pass_, (rows, cum) in ((WINDOW, (starts, starts)), (GLOBAL, pack_global(gate.T[None]))):
        launch = functools.partial(prefill, pass_=pass_, cum=cum, rows=rows)
        launch(_setting(pass_, tiles, key + (f"t{autotune.length_bucket(tokens)}",), q, launch, longest))
    return out


def _setting(kernel: str, tiles: dict | None, key: tuple, q: torch.Tensor, launch, length: int) -> dict:
    """The launch setting of a paged kernel that borrows ``kernel``'s candidates: pinned by ``tiles``, else
    ``autotune.setting`` (tuned on the GPU under ``key``, the default in the interpreter)."""
    return pinned_tiles(kernel, tiles) or autotune.setting(kernel, key, q.device, launch, q.shape[-1],
                                                          q.element_size(), length=length)


def _only(setting: dict, tile: str) -> dict:
    """The part of a setting a kernel takes: its ``tile`` constant (SPLIT or BLOCK_M), BLOCK_N and Triton's
    launch options (no tensor descriptors: the keys are gathered through the block table)."""
    return {name: setting[name] for name in (tile, "BLOCK_N", "num_warps", "num_stages")}


# Head dims: a power of two (``tl.arange(0, D)``), at least 16 (``tl.dot``'s smallest tile side), at most 128.
# The kernels' arithmetic is written for any D, but their launch settings are not: they borrow the candidates of
# ``tiles`` (sized for head dims 64-128). At 256 the prefill's default tile (64 queries, 64 keys, 3 stages) needs
# at least 224 KiB of shared memory in fp16 / bf16, the dense kernels' same default more than an H100 gives a
# block (``allhere.ops.aha.triton_path``, which refuses the same range), and 448 KiB in fp32 (a served fp32
# cache), more than any GPU gives. Where no candidate fits, ``tiles.prune`` keeps the default and it is launched
# anyway (so is a setting passed as ``tiles``); the decode's [BLOCK_N, D] fp32 products would spill. No head dim
# above 128 has been compiled or checked here: refused rather than run untested.
HEAD_DIMS = (16, 128)


def refusal(head_dim: int, softcap: float = 0.0, sinks: bool = False) -> str | None:
    """None where the paged kernels take a layer of head dim ``head_dim`` whose scores are soft-capped at
    ``softcap`` (0: none) and whose softmax has learned sink logits (``sinks``), else why not (one line): the
    static rule of ``paged_aha_attention`` (``_check``) and of a served layer (``allhere.ops.paged.aha_triton``)."""
    lo, hi = HEAD_DIMS
    if not lo <= head_dim <= hi or head_dim & (head_dim - 1):
        return f"head dim {head_dim}: the paged kernels take a power of two from {lo} to {hi}"
    if softcap:
        return "soft-capped scores (the paged kernels do not cap them)"
    if sinks:
        return "learned sink logits (the paged kernels have no extra softmax term)"
    return None


def _check(q, k_cache, v_cache, block_table, query_start, seq_lens, gate, window, out, sinks) -> tuple[int, ...]:
    """(tokens, heads, d, kv_heads, block_size) of a call, or a ValueError naming what does not fit."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [tokens, heads, d] and k/v caches [blocks, block_size, kv_heads, d] of one "
                         f"shape, got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    tokens, heads, d = q.shape
    _, block_size, kv_heads, dk = k_cache.shape
    if dk != d or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the cache's kv heads ({kv_heads}) and the "
                         f"head dims must match ({d} vs {dk})")
    why = refusal(d)
    if why is not None:
        raise ValueError(why)
    reqs = block_table.shape[0] if block_table.dim() == 2 else -1
    if reqs < 0 or tuple(query_start.shape) != (reqs + 1,) or tuple(seq_lens.shape) != (reqs,):
        raise ValueError(f"expected block_table [reqs, max_blocks], query_start [reqs + 1], seq_lens [reqs], got "
                         f"{tuple(block_table.shape)}, {tuple(query_start.shape)}, {tuple(seq_lens.shape)}")
    if tuple(gate.shape) != (tokens, heads) or out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"expected gate [{tokens}, {heads}] and out {tuple(q.shape)} with a unit-stride last "
                         f"dimension, got {tuple(gate.shape)}, {tuple(out.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")
    return tokens, heads, d, kv_heads, block_size
