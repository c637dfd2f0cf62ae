"""vLLM's own CPU attention kernel over allhere's paged cache, and AHA's served step through it.

allhere's block layout is the one vLLM's CPU kernel reads in its "vec" / "vec16" variants (x86 without AMX:
keys transposed, then values; checked once per process by writing a few tokens both ways: ``same_layout``).
Where the layer's kernel is one of those, AHA's step runs mostly in vLLM's own kernel over the same blocks, in
place (``aha_over_vllm``): every row's window in its windowed kernel, a decode token's global rows in its full
kernel, one request per (token, kv head) over that kv head's blocks (``vllm_global_decode``); allhere's attention
computes the prefill tokens' global rows. With one sink (``AHAConfig.sinks = 1``: its local rows also read the
request's first token) the decode tokens' windows are vLLM's too, the sink swapped in for the call
(``vllm_sink_window_decode``), and the prefill tokens' rows are a few calls of torch's fused attention per request
(``allhere.ops.paged.aha_prefill``).

A decode step at batch 1 costs what its tensor operations cost, thirty layers over, so what follows from the
step's tables alone (which requests decode, where a sink is swapped, the kernel's scheduler metadata) is made
once per step, by its first layer, in the step's ``PagedStepPlan`` (``step_plan``), as vLLM's metadata builder
makes its scheduler metadata once per step for its own layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from vllm import _custom_ops as ops
from vllm import envs

from ...ops.paged.aha_prefill import aha_prefill
from ...ops.paged.attention import paged_attention, paged_view, write
from ...ops.paged.step_plan import PagedStepPlan

VLLM_WINDOW_OFFSET = 0  # vLLM sliding_window = allhere window + this (both count the query's own key)
LAYOUT_ISAS = ("vec", "vec16")  # vLLM CPU kernels that read allhere's block layout (if the check below agrees)
PLAN_ATTR = "_allhere_plan"  # on vLLM's attention metadata of a step: the step's PagedStepPlan
_LAYOUT_CHECKED: dict[tuple, bool] = {}


def same_layout(isa: str, dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU cache writer for ``isa`` stores tokens as ``allhere.ops.paged.attention.write`` does (once per
    process and (isa, dtype))."""
    key = (isa, dtype)
    if key not in _LAYOUT_CHECKED:
        ok = isa in LAYOUT_ISAS
        if ok:
            nb, kvh, bs, d = 3, 2, 32, 32
            g = torch.Generator().manual_seed(0)
            k, v = (torch.randn(40, kvh, d, generator=g).to(dtype) for _ in range(2))
            slots = torch.randperm(nb * bs, generator=g)[:40]
            theirs, ours = torch.zeros(nb, kvh, bs, 2 * d, dtype=dtype), torch.zeros(nb, kvh, bs, 2 * d, dtype=dtype)
            try:
                vllm_write(theirs, k, v, slots, isa)
                write(paged_view(ours, bs, kvh, d), slots, k, v)
                ok = torch.equal(theirs, ours)
            except (RuntimeError, NotImplementedError):
                ok = False
        _LAYOUT_CHECKED[key] = ok
    return _LAYOUT_CHECKED[key]


def step_plan(meta) -> PagedStepPlan:
    """The ``PagedStepPlan`` of the step whose attention metadata (one KV cache group's) is ``meta``: made by the
    step's first layer that asks and kept on ``meta``, which vLLM builds anew every step and hands to each layer
    of the group, so the plan lives as long as its step."""
    plan = getattr(meta, PLAN_ATTR, None)
    if plan is None:
        plan = PagedStepPlan(meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_actual_tokens)
        setattr(meta, PLAN_ATTR, plan)
    return plan


def vllm_write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """vLLM's CPU cache writer: k, v [tokens, kv_heads, d] at ``slots`` [tokens] (int64; negative: skipped) of
    ``cache`` [blocks, kv_heads, block_size, 2 x d], one call for both."""
    nb, kv_heads, bs, _ = cache.shape
    kc, vc = cache.view(nb, kv_heads, 2 * bs, k.shape[2]).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)


def schedule(query_start, seq_lens, heads: int, kv_heads: int, d: int, dtype, window: int, isa: str) -> torch.Tensor:
    """vLLM's scheduler metadata for one call of its kernel (``vllm_attention``) over these requests."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(), num_heads=heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=window, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)


def vllm_attention(q, kv, out, query_start, seq_lens, block_table, window: int, scale: float, softcap: float,
                   sinks, isa: str, sched: torch.Tensor | None = None) -> None:
    """vLLM's CPU attention kernel, causal, over ``kv`` [blocks, kv_heads, 2 x block_size, d] (each block's keys
    then its values, allhere's layout): q and out [tokens, heads, d]; ``window`` keys in vLLM's convention (-1:
    every key); ``sched``: its ``schedule`` where the caller keeps one."""
    kc, vc = kv.chunk(2, dim=2)
    if sched is None:
        sched = schedule(query_start, seq_lens, q.shape[1], kv.shape[1], q.shape[2], q.dtype, window, isa)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=query_start, seq_lens=seq_lens,
        scale=scale, causal=True, alibi_slopes=None, sliding_window=window, block_table=block_table,
        softcap=softcap, scheduler_metadata=sched, s_aux=sinks)


def vllm_window(q, cache, meta, window: int, scale: float, softcap: float, sinks, isa: str, out) -> None:
    """vLLM's own CPU attention over ``cache`` (in allhere's layout, which is the kernel's), every query
    reading its ``window`` most recent keys: ``out`` [tokens, heads, d] for the first meta.num_actual_tokens."""
    nb, kv_heads, bs, _ = cache.shape
    n, heads, d = meta.num_actual_tokens, q.shape[1], q.shape[2]
    seq = meta.seq_lens[:meta.query_start_loc.numel() - 1]
    w = window + VLLM_WINDOW_OFFSET
    sched = step_plan(meta).part(("window schedule", heads, kv_heads, d, q.dtype, w, isa),
                                 lambda: schedule(meta.query_start_loc, seq, heads, kv_heads, d, q.dtype, w, isa))
    vllm_attention(q[:n], cache.view(nb, kv_heads, 2 * bs, d), out[:n], meta.query_start_loc, seq, meta.block_table,
                   w, scale, softcap, sinks, isa, sched)


class DecodeRequests(NamedTuple):
    """The step's decode requests (one query each) as ``vllm_global_decode`` reads them at every layer."""

    tok: torch.Tensor  # [m] their token
    every: bool  # they are all of the step's tokens, in order (tok is 0 .. m - 1)
    tables: torch.Tensor  # [m, >=] their block table rows x kv_heads (block b of kv head g: b x kv_heads + g)
    seq_lens: torch.Tensor  # [m] int32
    starts: torch.Tensor  # [m x kv_heads + 1] int32: 0, 1, 2, ... (one query per request of the kernel's call)


def decode_indices(meta) -> torch.Tensor:
    """The step's requests with one query (decode), by their index in its metadata [m]."""
    starts = meta.query_start_loc.long()
    return ((starts[1:] - starts[:-1]) == 1).nonzero().squeeze(1)


def decode_requests(meta, kv_heads: int) -> DecodeRequests:
    starts, req = meta.query_start_loc.long(), decode_indices(meta)
    m = req.numel()
    return DecodeRequests(starts[:-1][req], m == meta.num_actual_tokens, meta.block_table[req].long() * kv_heads,
                          meta.seq_lens[req].to(torch.int32),
                          torch.arange(m * kv_heads + 1, dtype=torch.int32, device=starts.device))


def vllm_global_decode(q, cache, meta, glob, scale: float, softcap: float, isa: str, out) -> torch.Tensor:
    """The global rows of the step's decode tokens (requests with one query) by vLLM's own CPU kernel, full causal
    attention: each (decode token, kv head) with a global row is a request of its own over that kv head's blocks
    alone (the cache [blocks, kv_heads, ...] read as [blocks x kv_heads, 1, ...], block b of kv head g being
    b x kv_heads + g), with the query heads of that kv head as its heads. The heads of such a group that are
    local are computed too and dropped: a kv head's keys are read once for all its heads, as vLLM's kernel
    reads them. ``glob`` [tokens, heads] bool; writes those rows of ``out`` [tokens, heads, d]. Returns the
    decode tokens [m] (all of whose global rows are now done). No learned sink logits (they are per head, and
    a request here holds another subset of heads each)."""
    nb, kv_heads, bs, _ = cache.shape
    heads, d = q.shape[1], q.shape[2]
    group = heads // kv_heads
    dr = step_plan(meta).part(("decode requests", kv_heads), lambda: decode_requests(meta, kv_heads))
    sel = (glob if dr.every else glob[dr.tok]).view(-1, kv_heads, group)  # [decode tokens, kv heads, group]
    ti, g = sel.any(-1).nonzero(as_tuple=True)
    tiles = ti.numel()
    if tiles == 0:
        return dr.tok
    rows = ti if dr.every else dr.tok[ti]
    qt = q.view(-1, kv_heads, group, d)[rows, g]  # [tiles, group, d] (a copy)
    o = torch.empty_like(qt)
    vllm_attention(qt, cache.view(nb * kv_heads, 1, 2 * bs, d), o, dr.starts[:tiles + 1], dr.seq_lens[ti],
                   (dr.tables[ti] + g[:, None]).to(torch.int32), -1, scale, softcap, None, isa)
    ov = out.view(-1, kv_heads, group, d)
    ov[rows, g] = torch.where(sel[ti, g][..., None], o, ov[rows, g])
    return dr.tok


def sink_swaps(meta, window: int, bs: int):
    """Which of the step's decode requests ``vllm_sink_window_decode`` computes, and where it swaps: (requests [m],
    the swaps' index among them [s], their block [s] and row [s]); the same for every layer of the step. A request
    at position p swaps position p - window where that is >= 1 (else a window of window + 1 reads the sink as it
    is); a request whose swapped slot another request would read (blocks shared by prefix caching), and that
    reader, are left out."""
    dec = decode_indices(meta)
    pos = meta.seq_lens[dec].long() - 1
    table = meta.block_table[dec].long()
    at = pos - window
    swap = (at >= 1).nonzero().squeeze(1)
    blocks, rows = table[swap, at[swap] // bs], at[swap] % bs
    # who reads whose swapped slot: request i's keys at positions at_i .. pos_i, in blocks of its own table
    low = at.clamp_min(0)
    cols = torch.arange(table.shape[1], device=table.device)
    span = (cols >= (low // bs)[:, None]) & (cols <= (pos // bs)[:, None])  # [requests, columns]
    slot_pos = cols[None, None, :] * bs + rows[None, :, None]  # [1, swaps, columns]: the slot's position in i
    reads = ((table[:, None, :] == blocks[None, :, None]) & span[:, None, :] & (slot_pos >= low[:, None, None])
             & (slot_pos <= pos[:, None, None])).any(-1)  # [requests, swaps]
    reads[swap, torch.arange(swap.numel(), device=swap.device)] = False  # its own slot: that is the point
    clash = reads.any(1)
    clash[swap[reads.any(0)]] = True
    if bool(clash.any()):
        keep = ~clash[swap]
        swap = torch.searchsorted((~clash).nonzero().squeeze(1), swap[keep])
        dec, blocks, rows = dec[~clash], blocks[keep], rows[keep]
    return dec, swap, blocks, rows


def slot_elements(blocks: torch.Tensor, rows: torch.Tensor, kv_heads: int, bs: int, d: int) -> torch.Tensor:
    """Where the keys and values stored at (block, row) pairs [s] lie in a layer's cache read flat (blocks of
    [kv_heads, 2, bs, d], each kv head's keys transposed as [d, bs], then its values): [s x kv_heads x 2 x d]."""
    head = torch.arange(kv_heads, device=blocks.device)[:, None] * (2 * bs * d)
    j = torch.arange(d, device=blocks.device)
    base = (blocks * (kv_heads * 2 * bs * d))[:, None, None]
    keys = base + rows[:, None, None] + head + j * bs
    values = base + (rows * d)[:, None, None] + head + bs * d + j
    return torch.stack([keys, values], dim=2).flatten()


class SinkWindow(NamedTuple):
    """What ``vllm_sink_window_decode`` does at every layer of a step: one kernel call over the decode requests
    ``sink_swaps`` keeps, with the sink swapped in at the slots ``swapped`` (``slot_elements``) from ``sink``."""

    tok: torch.Tensor  # [m] the tokens computed
    every: bool  # they are all of the step's tokens, in order
    swapped: torch.Tensor  # [e] the swapped slots' keys and values in the cache read flat
    read: torch.Tensor  # [2e] the same, then their request's first token's
    query_start: torch.Tensor  # the call's requests: [m + 1]
    seq_lens: torch.Tensor  # [m]
    block_table: torch.Tensor  # [m, >=]
    window: int  # in vLLM's convention: the window and the key just before it
    sched: torch.Tensor | None  # vLLM's scheduler metadata for the call (None: no call)


def sink_window(meta, window: int, bs: int, heads: int, kv_heads: int, d: int, dtype, isa: str) -> SinkWindow:
    dec, swap, blocks, rows = sink_swaps(meta, window, bs)
    m = dec.numel()
    starts = torch.arange(m + 1, dtype=torch.int32, device=dec.device)
    seq, table = meta.seq_lens[dec], meta.block_table[dec]
    w = window + 1 + VLLM_WINDOW_OFFSET
    swapped = slot_elements(blocks, rows, kv_heads, bs, d)
    sink = slot_elements(table[swap, 0].long(), torch.zeros_like(rows), kv_heads, bs, d)
    return SinkWindow(meta.query_start_loc[dec].long(), m == meta.num_actual_tokens, swapped,
                      torch.cat([swapped, sink]), starts, seq, table, w,
                      schedule(starts, seq, heads, kv_heads, d, dtype, w, isa) if m else None)


def vllm_sink_window_decode(q, cache, meta, window: int, scale: float, softcap: float, sinks, isa: str,
                            out) -> torch.Tensor:
    """The local rows of the step's decode tokens for AHA with one attention sink (a local row at position p reads
    key 0 and keys p - window + 1 .. p) by vLLM's windowed kernel, which reads no sinks: for the call, the key and
    value at position p - window (the one just before the window) are replaced by the request's first, so a window
    of window + 1 reads exactly the sink and the window; they are put back after (``sink_swaps`` says which
    requests and slots). ``cache`` [blocks, kv_heads, block_size, 2 x d] (contiguous). Every head's row of the
    decode tokens done is written to ``out`` [tokens, heads, d]; returns those tokens [m]."""
    nb, kv_heads, bs, _ = cache.shape
    heads, d = q.shape[1], q.shape[2]
    sw = step_plan(meta).part(("sink window", window, bs, heads, kv_heads, d, q.dtype, isa),
                              lambda: sink_window(meta, window, bs, heads, kv_heads, d, q.dtype, isa))
    m = sw.tok.numel()
    if m == 0:
        return sw.tok
    flat = cache.view(-1)
    o = out[:m] if sw.every else q.new_empty(m, heads, d)
    e = sw.swapped.numel()
    got = flat.index_select(0, sw.read)  # what the swapped slots hold, then the sinks
    try:
        flat.put_(sw.swapped, got[e:])
        vllm_attention(q[:m] if sw.every else q[sw.tok], cache.view(nb, kv_heads, 2 * bs, d), o, sw.query_start,
                       sw.seq_lens, sw.block_table, sw.window, scale, softcap, sinks, isa, sw.sched)
    finally:
        flat.put_(sw.swapped, got[:e])
    if not sw.every:
        out[sw.tok] = o
    return sw.tok


def past_window(plan: PagedStepPlan, window: int) -> torch.Tensor | bool:
    """Which of the step's tokens have keys before their window of ``window`` (position >= window): [n, 1] bool,
    or True (all of them), False (none: a short prompt, every row local)."""
    past = plan.token_positions()[1] >= window
    return True if bool(past.all()) else (past[:, None] if bool(past.any()) else False)


def aha_over_vllm(q, cache, view, meta, reads, row_class, local: int, scale: float, softcap: float, sinks,
                  isa: str, out, workspace) -> None:
    """AHA's step on vLLM's CPU backend where its kernel reads allhere's layout: every row's window by vLLM's
    windowed kernel (with one attention sink: the decode tokens' windows, ``vllm_sink_window_decode``); the decode
    tokens' global rows by its full kernel per (token, kv head) (``vllm_global_decode``); with a sink, the prefill
    tokens' rows in a few large calls of torch's fused attention (``allhere.ops.paged.aha_prefill``); what is left
    (the prefill tokens' global rows without a sink, learned sink logits, a soft cap, decode tokens sharing a
    swapped slot) by allhere's general attention (``paged_attention`` with the layer's ``reads``). ``row_class``
    [tokens, heads]: ``local`` for a local row, whose one read is a ``window_read`` with at most one sink. ``out``
    [tokens, heads, d]: the first meta.num_actual_tokens rows."""
    window_read = reads[local][0]
    if window_read.n_sinks > 1:
        raise ValueError("aha_over_vllm: more than one sink is read by paged_attention")
    n = meta.num_actual_tokens
    rows = row_class[:n]
    glob = rows if rows.dtype == torch.bool and local == 0 else rows != local  # AHA's gate is that already
    plan = step_plan(meta)
    reach = plan.part(("past window", window_read.window), lambda: past_window(plan, window_read.window))
    if reach is not True:  # a global row of a token whose window holds all its keys is its local row
        glob = glob & reach
    if window_read.n_sinks:
        tok = vllm_sink_window_decode(q, cache, meta, window_read.window, scale, softcap, sinks, isa, out)
        windows_done = tok.numel() == n
    else:
        vllm_window(q, cache, meta, window_read.window, scale, softcap, sinks, isa, out)
        tok, windows_done = slice(None), True
    all_local = not bool(glob.any())
    decode_globals = sinks is None and not all_local
    if decode_globals:
        global_tok = vllm_global_decode(q, cache, meta, glob, scale, softcap, isa, out)
    if windows_done and (all_local or (decode_globals and plan.decodes_only())):
        return  # every row done: a step of decode tokens (or of local rows only), the usual step of a server
    is_local = ~glob
    done = torch.zeros_like(is_local)
    done[tok] = is_local[tok]
    if decode_globals:
        done[global_tok] |= ~is_local[global_tok]
    if window_read.n_sinks and sinks is None and not softcap and not bool(done.all()):
        # the prefill tokens' rows in a few large calls (without a sink, vLLM's window kernel has their local rows
        # and ``paged_attention`` their global ones, which measured no slower than these calls)
        written = aha_prefill(q, view, meta.query_start_loc, meta.seq_lens, meta.block_table, is_local,
                              window_read.window, window_read.n_sinks, scale, out)
        done |= written[:n, None]
    if bool(done.all()):
        return
    rest = torch.where(done, len(reads), row_class[:n].long())  # class len(reads) reads nothing: rows done
    paged_attention(q[:n], view, meta.query_start_loc, meta.seq_lens, meta.block_table, [*reads, []], scale, out,
                    row_class=rest, sinks=None if sinks is None else sinks.float(), softcap=softcap,
                    workspace=workspace, positions=step_plan(meta).token_positions())
