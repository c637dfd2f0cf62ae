"""allhere's attention inside vLLM: one custom op per converted layer over the layer's paged KV cache
(``allhere.ops.paged.attention``), for every mechanism that reads a subset of its keys (AHA, attention sinks, dilated
windows, Longformer, BigBird, DAR).

The converted layer's own vLLM ``Attention`` stays, only as the owner of a paged cache tensor: vLLM sizes it
(its spec is the unconverted layer's, full attention, every key kept; a sinks layer's and DAR's window keep
fewer: ``allhere.serve.vllm.sink_cache``, ``allhere.serve.vllm.dar``), hands its blocks to requests, keeps them
for prefix caching and frees them; its kernel is never called. ``PagedAttention`` (standing where the block's
``attn`` stood) writes the step's keys and values into that tensor at vLLM's slot mapping and attends over it
with ``paged_attention``, for the whole batch in one call, reading per (request, query head) only what the
mechanism's rule allows through vLLM's block table. It runs as one custom op (``allhere::paged_attention``),
so vLLM's torch.compile sees one opaque call; a per-(token, head) row class (AHA's gate) is its argument.

allhere's block layout is the one vLLM's CPU kernel reads in its "vec" / "vec16" variants (x86 without AMX:
keys transposed, then values; checked once per process by writing a few tokens both ways). Where the layer's
kernel is one of those, AHA's step runs mostly in vLLM's own kernel over the same blocks, in place: every row's
window in its windowed kernel, a decode token's global rows in its full kernel, one request per (token, kv head)
over that kv head's blocks (``vllm_global_decode``); allhere's attention computes the prefill tokens' global rows.
With one sink (``AHAConfig.sinks = 1``: its local rows also read the request's first token) the decode tokens'
windows are vLLM's too, the sink swapped in for the call (``vllm_sink_window_decode``), and the prefill tokens'
rows are a few calls of torch's fused attention per request (``allhere.ops.paged.aha_prefill``); with more sinks,
allhere's attention computes every row (``PagedAttention.compute`` says why). An AHA layer on CUDA runs allhere's
Triton paged kernel for all its rows instead (``allhere.ops.paged.aha_triton``; its keys stored untransposed).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import nn
from vllm import _custom_ops as ops
from vllm import envs
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context

from ...backend import OpPath, get_backend, select
from ...ops.paged.aha_prefill import aha_prefill
from ...ops.paged.attention import Read, paged_attention, paged_view, write
from ...ops.paged.chunks import Workspace
from ...ops.paged.dispatch import OP, transposed_for
from ...ops.paged.step_plan import PagedStepPlan
from ..serving import BACKEND_ENV

PAGED_ATTR = "_allhere_paged"  # on the owner Attention: [its PagedAttention] (a list: no module cycle)
VLLM_WINDOW_OFFSET = 0  # vLLM sliding_window = allhere window + this (both count the query's own key)
LAYOUT_ISAS = ("vec", "vec16")  # vLLM CPU kernels that read allhere's block layout (if the check below agrees)
WORKSPACE = Workspace()  # the gathered keys' memory, reused by every layer of this process (they run in turn)
PLAN_ATTR = "_allhere_plan"  # on vLLM's attention metadata of a step: the step's PagedStepPlan
# Query rows per tile: rows that read a window go in tiles of 64 (their keys span the tile plus the window); rows
# that read every earlier key in tiles of 256 (the keys they gather are shared by more rows)
WINDOW_TILE, WIDE_TILE = 64, 256
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
            kc, vc = theirs.view(nb, kvh, 2 * bs, d).chunk(2, dim=2)
            try:
                ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
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


def vllm_window(q, cache, meta, window: int, scale: float, softcap: float, sinks, isa: str, out) -> None:
    """vLLM's own CPU attention over ``cache`` (in allhere's layout, which is the kernel's), every query
    reading its ``window`` most recent keys: ``out`` [tokens, heads, d] for the first meta.num_actual_tokens."""
    nb, kv_heads, bs, _ = cache.shape
    n, d = meta.num_actual_tokens, q.shape[2]
    reqs = meta.query_start_loc.numel() - 1
    vllm_attention(q[:n], cache.view(nb, kv_heads, 2 * bs, d), out[:n], meta.query_start_loc, meta.seq_lens[:reqs],
                   meta.block_table, window + VLLM_WINDOW_OFFSET, scale, softcap, sinks, isa)


def vllm_attention(q, kv, out, query_start, seq_lens, block_table, window: int, scale: float, softcap: float,
                   sinks, isa: str) -> None:
    """vLLM's CPU attention kernel, causal, over ``kv`` [blocks, kv_heads, 2 x block_size, d] (each block's keys
    then its values, allhere's layout): q and out [tokens, heads, d]; ``window`` keys in vLLM's convention (-1:
    every key)."""
    kc, vc = kv.chunk(2, dim=2)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(), num_heads=q.shape[1], num_kv_heads=kv.shape[1], head_dim=q.shape[2],
        seq_lens=seq_lens, dtype=q.dtype, query_start_loc=query_start, causal=True, sliding_window_size=window,
        isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=query_start, seq_lens=seq_lens,
        scale=scale, causal=True, alibi_slopes=None, sliding_window=window, block_table=block_table,
        softcap=softcap, scheduler_metadata=sched, s_aux=sinks)


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
    starts = meta.query_start_loc.long()
    req = ((starts[1:] - starts[:-1]) == 1).nonzero().squeeze(1)
    tok = starts[:-1][req]
    sel = glob[tok].view(-1, kv_heads, group)  # [decode tokens, kv heads, group]
    ti, g = sel.any(-1).nonzero(as_tuple=True)
    if ti.numel() == 0:
        return tok
    table = (meta.block_table[req[ti]].long() * kv_heads + g[:, None]).to(torch.int32)
    starts_t = torch.arange(ti.numel() + 1, dtype=torch.int32, device=q.device)
    qt = q.view(-1, kv_heads, group, d)[tok[ti], g]  # [tiles, group, d] (a copy)
    o = torch.empty_like(qt)
    vllm_attention(qt, cache.view(nb * kv_heads, 1, 2 * bs, d), o, starts_t, meta.seq_lens[req[ti]].to(torch.int32),
                   table, -1, scale, softcap, None, isa)
    ov = out.view(-1, kv_heads, group, d)
    ov[tok[ti], g] = torch.where(sel[ti, g][..., None], o, ov[tok[ti], g])
    return tok


def read_slots(view: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [m, kv_heads, d] stored at (block, row) pairs of a ``paged_view`` (keys transposed, as
    ``allhere.ops.paged.attention.write`` stores them)."""
    nb, kv_heads, _, bs, d = view.shape
    return view[:, :, 0].view(nb, kv_heads, d, bs)[blocks, :, :, rows], view[blocks, :, 1, rows]


def sink_swaps(meta, window: int, bs: int):
    """Which of the step's decode requests ``vllm_sink_window_decode`` computes, and where it swaps: (requests [m],
    the swaps' index among them [s], their block [s] and row [s]); the same for every layer of the step. A request
    at position p swaps position p - window where that is >= 1 (else a window of window + 1 reads the sink as it
    is); a request whose swapped slot another request would read (blocks shared by prefix caching), and that
    reader, are left out."""
    starts = meta.query_start_loc.long()
    dec = ((starts[1:] - starts[:-1]) == 1).nonzero().squeeze(1)
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


def vllm_sink_window_decode(q, cache, view, meta, window: int, scale: float, softcap: float, sinks, isa: str,
                            out) -> torch.Tensor:
    """The local rows of the step's decode tokens for AHA with one attention sink (a local row at position p reads
    key 0 and keys p - window + 1 .. p) by vLLM's windowed kernel, which reads no sinks: for the call, the key and
    value at position p - window (the one just before the window) are replaced by the request's first, so a window
    of window + 1 reads exactly the sink and the window; they are put back after (``sink_swaps`` says which
    requests and slots). Every head's row of the decode tokens done is written to ``out`` [tokens, heads, d];
    returns those tokens [m]."""
    bs = view.shape[3]
    dec, swap, blocks, rows = step_plan(meta).part(("sink swaps", window, bs), lambda: sink_swaps(meta, window, bs))
    if dec.numel() == 0:
        return dec
    tok = meta.query_start_loc[dec].long()
    saved = read_slots(view, blocks, rows)
    sink = read_slots(view, meta.block_table[dec[swap], 0].long(), torch.zeros_like(rows))
    slots = blocks * bs + rows
    every = tok.numel() == meta.num_actual_tokens  # a step of decode tokens only: q and out as they are
    o = out[:tok.numel()] if every else q.new_empty(tok.numel(), *q.shape[1:])
    try:
        write(view, slots, *sink, places=(None, blocks, rows))
        nb, kv_heads = cache.shape[:2]
        vllm_attention(q[:tok.numel()] if every else q[tok], cache.view(nb, kv_heads, 2 * bs, q.shape[2]), o,
                       torch.arange(tok.numel() + 1, dtype=torch.int32, device=q.device), meta.seq_lens[dec],
                       meta.block_table[dec], window + 1 + VLLM_WINDOW_OFFSET, scale, softcap, sinks, isa)
    finally:
        write(view, slots, *saved, places=(None, blocks, rows))
    if not every:
        out[tok] = o
    return tok


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
    is_local = row_class[:n] == local
    done = torch.zeros_like(is_local)
    if window_read.n_sinks:
        tok = vllm_sink_window_decode(q, cache, view, meta, window_read.window, scale, softcap, sinks, isa, out)
    else:
        vllm_window(q, cache, meta, window_read.window, scale, softcap, sinks, isa, out)
        tok = slice(None)
    done[tok] = is_local[tok]
    if sinks is None and not bool(is_local.all()):
        tok = vllm_global_decode(q, cache, meta, ~is_local, scale, softcap, isa, out)
        done[tok] |= ~is_local[tok]
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


def host_softmax_terms(attn: Attention) -> tuple[float, torch.Tensor | None]:
    """(soft cap of the scores, 0 if none; learned sink logits [heads] or None) of a vLLM ``Attention``."""
    return float(getattr(attn.impl, "logits_soft_cap", 0) or 0.0), getattr(attn.impl, "sinks", None)


def refuse_softmax_terms(attn: Attention) -> None:
    """For the mechanisms that do not compute the host's soft-capped scores or learned sink logits
    (``Serving.softmax_terms`` False: ``allhere.serve.vllm.install`` calls it on every converted layer)."""
    softcap, sinks = host_softmax_terms(attn)
    if softcap or sinks is not None:
        raise NotImplementedError(f"allhere vLLM serving: {attn.layer_name} has soft-capped scores or learned "
                                  "sinks, which this mechanism does not compute")


@torch.library.custom_op("allhere::paged_attention", mutates_args=("out",))
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: torch.Tensor | None,
                        out: torch.Tensor, layer: str) -> None:
    """``aux``: a per-token input of the mechanism (AHA: the router's gate; DAR: the block's input)."""
    # the layer of the engine running now (vLLM's forward context), not a process-wide registry
    _, owner, _, _ = get_attention_context(layer)
    getattr(owner, PAGED_ATTR)[0].compute(q, k, v, aux, out)


@_paged_attention_op.register_fake
def _(q, k, v, aux, out, layer) -> None:
    return None


class PagedAttention(nn.Module):
    """Stands where the block's ``attn`` stood. ``owner``: the layer's vLLM ``Attention``, used for its cache only;
    ``reads``: per row class, what a row reads (``allhere.ops.paged.attention``). The host's learned sink logits and
    soft-capped scores, where the owner has them, are computed (a mechanism that does not compute them was
    refused before: ``Serving.softmax_terms``). ``router``: a module whose ``gate`` [tokens, heads] (set by the
    block's pre-hook) is the row class of this step. ``window_class``: the class whose rows read exactly their
    window most recent keys (its one part a ``window_read``, which holds the window), for vLLM's windowed kernel
    where it reads allhere's layout and for the Triton paged kernel (AHA)."""

    def __init__(self, owner: Attention, reads: Sequence[Sequence[Read]], router: nn.Module | None = None,
                 window_class: int | None = None) -> None:
        super().__init__()
        self.softcap, self.sinks = host_softmax_terms(owner)
        if window_class is not None and (len(reads[window_class]) != 1 or reads[window_class][0].window is None):
            raise ValueError(f"allhere: row class {window_class} of {owner.layer_name} must read one window_read")
        self.owner = owner
        self.reads = reads
        self.window_class = window_class
        self._router = [router] if router is not None else []  # a plain reference: registered under the block
        self.heads, self.kv_heads, self.head_dim = owner.num_heads, owner.num_kv_heads, owner.head_size
        self.scale = float(owner.impl.scale)
        self.layer_name = owner.layer_name
        self.backend = os.environ.get(BACKEND_ENV) or get_backend()
        self.path: OpPath | None = None  # of op family "paged": chosen at the first step with a cache, kept for life
        object.__setattr__(owner, PAGED_ATTR, [self])

    def forward(self, q, k, v, *args, **kwargs):
        out = torch.empty(q.shape[0], self.heads * self.head_dim, dtype=q.dtype, device=q.device)
        torch.ops.allhere.paged_attention(q, k, v, self.aux(), out, self.layer_name)
        return out

    def aux(self) -> torch.Tensor | None:
        """The op's per-token input: the row class (AHA's gate, set by the block's pre-hook), or None."""
        if not self._router:
            return None
        row_class, self._router[0].gate = self._router[0].gate, None
        if row_class is None:
            raise RuntimeError(f"allhere: {self.layer_name} called without its router's gate")
        return row_class

    def write_step(self, q, k, v, out):
        """Store the step's keys and values in the owner's cache at vLLM's slot mapping. Returns (metadata, the
        cache's paged view, q [tokens, heads, d], out [tokens, heads, d]), or None in vLLM's warm-up and memory
        profiling (no cache yet; ``out`` zeroed)."""
        meta, _, cache, _ = get_attention_context(self.layer_name)
        out = out.view(-1, self.heads, self.head_dim)
        if meta is None or cache.numel() == 0:
            out.zero_()
            return None
        n = meta.num_actual_tokens
        k, v = (t.view(-1, self.kv_heads, self.head_dim)[:n] for t in (k, v))
        view = paged_view(cache, cache.shape[2], self.kv_heads, self.head_dim)  # blocks of block_size tokens
        q = q.view(-1, self.heads, self.head_dim)
        if self.path is None:  # one path, hence one cache layout, for the layer's life
            self.path = select(OP, *self._args(q, view, meta, out), **self._options(None), backend=self.backend)
        slots = meta.slot_mapping[:n]
        places = step_plan(meta).slot_places(slots, view.shape[3])
        write(view, slots, k, v, transposed=transposed_for(self.path), places=places)
        return meta, view, q, out

    def _args(self, q, view, meta, out) -> tuple:
        return q, view, meta.query_start_loc, meta.seq_lens, meta.block_table, self.reads, self.scale, out

    def _options(self, row_class, extra=()) -> dict:
        return dict(row_class=row_class, window_class=self.window_class, softcap=self.softcap, extra=extra,
                    sinks=None if self.sinks is None else self.sinks.float(), workspace=WORKSPACE,
                    transposed=transposed_for(self.path) if self.path is not None else True)

    def attend(self, q, view, meta, row_class, out, extra=()) -> None:
        """The layer's path (``allhere.ops.paged.dispatch``) on the step; ``out[n:]`` zeroed."""
        self.path.fn(*self._args(q, view, meta, out), **self._options(row_class, extra),
                     max_seq_len=getattr(meta, "max_seq_len", None), max_query_len=getattr(meta, "max_query_len", None),
                     positions=step_plan(meta).token_positions())
        out[meta.num_actual_tokens:].zero_()

    def compute(self, q, k, v, row_class, out) -> None:
        step = self.write_step(q, k, v, out)
        if step is None:
            return
        meta, view, q, out = step
        c, isa = self.window_class, getattr(self.owner, "isa", None)
        # With more than one sink (AHA's local rows also reading the request's first tokens) every row stays on
        # allhere's path: vLLM's windowed kernel reads no sinks and returns no log-sum-exp, so a piece of sink keys
        # could not be merged into its output without computing the window's log-sum-exp again; one sink is swapped
        # in for the call (``vllm_sink_window_decode``)
        if (self.path.backend == "torch" and c is not None and self.reads[c][0].n_sinks <= 1
                and same_layout(isa, view.dtype)):
            aha_over_vllm(q, self.owner.kv_cache, view, meta, self.reads, row_class, c, self.scale, self.softcap,
                          self.sinks, isa, out, WORKSPACE)
            out[meta.num_actual_tokens:].zero_()
        else:
            self.attend(q, view, meta, row_class, out)
