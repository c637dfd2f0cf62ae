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

Where vLLM's CPU kernel reads allhere's block layout, AHA's step runs mostly in that kernel over the same blocks
(``allhere.serve.vllm.cpu_kernels``) and the step's keys are written by vLLM's own cache writer. An AHA layer on
CUDA runs allhere's Triton paged kernel for all its rows instead (``allhere.ops.paged.aha_triton``; its keys stored
untransposed).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import nn
from torch.library import Library
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.utils.torch_utils import direct_register_custom_op

from ...backend import OpPath, get_backend, select
from ...ops.paged.attention import Read, paged_view, write
from ...ops.paged.chunks import Workspace
from ...ops.paged.dispatch import OP, transposed_for
from ..serving import BACKEND_ENV
from .cpu_kernels import aha_over_vllm, same_layout, step_plan, vllm_write

PAGED_ATTR = "_allhere_paged"  # on the owner Attention: [its PagedAttention] (a list: no module cycle)
WORKSPACE = Workspace()  # the gathered keys' memory, reused by every layer of this process (they run in turn)
# Query rows per tile: rows that read a window go in tiles of 64 (their keys span the tile plus the window); rows
# that read every earlier key in tiles of 256 (the keys they gather are shared by more rows)
WINDOW_TILE, WIDE_TILE = 64, 256


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


def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: torch.Tensor | None,
                        out: torch.Tensor, layer: str) -> None:
    """``aux``: a per-token input of the mechanism (AHA: the router's gate; DAR: the block's input)."""
    # the layer of the engine running now (vLLM's forward context), not a process-wide registry
    meta, owner, cache, _ = get_attention_context(layer)
    getattr(owner, PAGED_ATTR)[0].compute(q, k, v, aux, out, meta, cache)


def _paged_attention_fake(q, k, v, aux, out, layer) -> None:
    return None


# Registered as vLLM registers its own attention op: straight into a library's dispatch table, without
# ``torch.library.custom_op``'s layers (about 20 us a call on a CPU, thirty layers a step)
_LIBRARY = Library("allhere", "FRAGMENT")  # the op lives as long as this object
direct_register_custom_op("paged_attention", _paged_attention_op, mutates_args=["out"],
                          fake_impl=_paged_attention_fake, target_lib=_LIBRARY)


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
        self.vllm_isa: str | None = None  # with the path: vLLM's CPU kernel variant where it reads the layer's layout
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

    def write_step(self, q, k, v, out, meta, cache):
        """Store the step's keys and values in the owner's cache (``cache``, from vLLM's forward context with the
        step's ``meta``) at vLLM's slot mapping. Returns (metadata, the cache's paged view, q [tokens, heads, d],
        out [tokens, heads, d]), or None in vLLM's warm-up and memory profiling (no cache yet; ``out`` zeroed)."""
        out = out.view(-1, self.heads, self.head_dim)
        if meta is None or cache.numel() == 0:
            out.zero_()
            return None
        n = meta.num_actual_tokens
        k, v = k.view(-1, self.kv_heads, self.head_dim)[:n], v.view(-1, self.kv_heads, self.head_dim)[:n]
        view = paged_view(cache, cache.shape[2], self.kv_heads, self.head_dim)  # blocks of block_size tokens
        q = q.view(-1, self.heads, self.head_dim)
        if self.path is None:  # one path, hence one cache layout, for the layer's life
            self.path = select(OP, *self._args(q, view, meta, out), **self._options(None), backend=self.backend)
            isa = getattr(self.owner, "isa", None)
            self.vllm_isa = isa if transposed_for(self.path) and same_layout(isa, cache.dtype) else None
        slots = meta.slot_mapping[:n]
        if self.vllm_isa is not None and k.dtype == cache.dtype:
            vllm_write(cache, k, v, slots, self.vllm_isa)  # vLLM's own writer stores allhere's layout: one call
        else:
            places = step_plan(meta).slot_places(slots, view.shape[3])
            write(view, slots, k, v, transposed=transposed_for(self.path), places=places)
        return meta, view, q, out

    def _args(self, q, view, meta, out, reads=None) -> tuple:
        return (q, view, meta.query_start_loc, meta.seq_lens, meta.block_table, self.reads if reads is None else reads,
                self.scale, out)

    def _options(self, row_class, extra=()) -> dict:
        return dict(row_class=row_class, window_class=self.window_class, softcap=self.softcap, extra=extra,
                    sinks=None if self.sinks is None else self.sinks.float(), workspace=WORKSPACE,
                    transposed=transposed_for(self.path) if self.path is not None else True)

    def attend(self, q, view, meta, row_class, out, extra=(), reads=None) -> None:
        """The layer's path (``allhere.ops.paged.dispatch``) on the step (``reads``: in place of the layer's);
        ``out[n:]`` zeroed."""
        self.path.fn(*self._args(q, view, meta, out, reads), **self._options(row_class, extra),
                     max_seq_len=getattr(meta, "max_seq_len", None), max_query_len=getattr(meta, "max_query_len", None),
                     positions=step_plan(meta).token_positions(), plan=step_plan(meta))
        out[meta.num_actual_tokens:].zero_()

    def compute(self, q, k, v, row_class, out, meta, cache) -> None:
        """The layer's attention on one step (``meta``, ``cache``: vLLM's forward context for the layer)."""
        step = self.write_step(q, k, v, out, meta, cache)
        if step is None:
            return
        meta, view, q, out = step
        c = self.window_class
        # With more than one sink (AHA's local rows also reading the request's first tokens) every row stays on
        # allhere's path: vLLM's windowed kernel reads no sinks and returns no log-sum-exp, so a piece of sink keys
        # could not be merged into its output without computing the window's log-sum-exp again; one sink is swapped
        # in for the call (``vllm_sink_window_decode``)
        if (self.vllm_isa is not None and self.path.backend == "torch" and c is not None
                and self.reads[c][0].n_sinks <= 1):
            aha_over_vllm(q, cache, view, meta, self.reads, row_class, c, self.scale, self.softcap, self.sinks,
                          self.vllm_isa, out, WORKSPACE)
            if out.shape[0] > meta.num_actual_tokens:
                out[meta.num_actual_tokens:].zero_()
        else:
            self.attend(q, view, meta, row_class, out)
