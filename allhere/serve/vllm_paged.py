"""vLLM layers for the mechanisms that no single vLLM attention computes: masked patterns (attention sinks,
dilated windows, Longformer, BigBird) and DAR. Imported by ``allhere.serve.vllm_model``, never by
``import allhere``.

The converted layer's own vLLM ``Attention`` stays, only as the owner of a paged cache tensor: vLLM sizes
it, hands its blocks to requests, keeps them for prefix caching and frees them; its kernel is never called.
``PagedAttention`` (standing where the block's ``attn`` stood) writes the step's keys and values into that
tensor and attends over it with ``allhere.serve.paged`` (its own layout, a dense float32 reference per
request). It runs as one custom op (``allhere::paged_attention``), so vLLM's torch.compile sees one opaque
call.

DAR needs two key sets per token: the full-dimensional K/V (read within the window) and those rebuilt from
the bottleneck, h' = (h W_down) W_up, through the same K/V path (read beyond it). A forward pre-hook on the
attention block appends h' to the block's input (the same positions again), so the host's own projections,
norms and rotary embedding make both in one pass; the first half of the tokens is the real one, the second
gives the distant K/V, stored in a second cache (``...self_attn.allhere.far``) with the same block table.
A forward hook drops the second half of the block's output. This caches both sets, twice the plain
model's KV bytes: exact, without DAR's saving (which needs a cache of d_down latents per token and the
distant K/V rebuilt every step).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context

from ..hosts import SUBMODULE
from .paged import Choose, dar_choice, masked_choice, paged_attention, paged_view, write

PAGED_ATTR = "_allhere_paged"  # on the owner Attention: [its PagedAttention] (a list: no module cycle)


@torch.library.custom_op("allhere::paged_attention", mutates_args=("out",))
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: str) -> None:
    # the layer of the engine running now (vLLM's forward context), not a process-wide registry
    _, owner, _, _ = get_attention_context(layer)
    getattr(owner, PAGED_ATTR)[0].compute(q, k, v, out)


@_paged_attention_op.register_fake
def _(q, k, v, out, layer) -> None:
    return None


class PagedAttention(nn.Module):
    """Stands where the block's ``attn`` stood. ``owners``: one vLLM ``Attention`` per key set (the layer's
    own first), used for their caches only; ``choose``: which set each (head, query, key) reads
    (``allhere.serve.paged``). With two sets the block runs on twice the tokens (DAR: see the module
    docstring): the first half are queries, keys and values, the second only keys and values."""

    def __init__(self, owners: list[Attention], choose: Choose) -> None:
        super().__init__()
        first = owners[0]
        for o in owners:
            if getattr(o.impl, "logits_soft_cap", 0) or getattr(o.impl, "sinks", None) is not None:
                raise NotImplementedError(f"allhere vLLM serving: {first.layer_name} has soft-capped scores or learned "
                                          "sinks, which this mechanism does not compute")
        self.owners = nn.ModuleList(owners)
        self.choose = choose
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_size
        self.scale = float(first.impl.scale)
        self.layer_name = first.layer_name
        object.__setattr__(first, PAGED_ATTR, [self])

    def forward(self, q, k, v, *args, **kwargs):
        out = torch.empty(q.shape[0], self.heads * self.head_dim, dtype=q.dtype, device=q.device)
        torch.ops.allhere.paged_attention(q, k, v, out, self.layer_name)
        return out

    def compute(self, q, k, v, out) -> None:
        meta, _, cache, _ = get_attention_context(self.layer_name)
        out = out.view(-1, self.heads, self.head_dim)
        if meta is None or cache.numel() == 0:  # vLLM's warm-up and memory profiling: no cache yet
            out.zero_()
            return
        sets, n = len(self.owners), meta.num_actual_tokens
        half = q.shape[0] // sets
        q = q.view(-1, self.heads, self.head_dim)
        k, v = (t.view(-1, self.kv_heads, self.head_dim) for t in (k, v))
        block_size = cache.shape[2]  # vLLM's CPU layout: [blocks, kv_heads, block_size, 2 x head_dim]
        views = [paged_view(o.kv_cache, block_size, self.kv_heads, self.head_dim) for o in self.owners]
        slots = meta.slot_mapping[:n]
        for i, view in enumerate(views):
            write(view, slots, k[i * half: i * half + n], v[i * half: i * half + n])
        paged_attention(q[:n], views, meta.query_start_loc, meta.seq_lens, meta.block_table, self.choose,
                        self.scale, out)
        out[n:].zero_()


class DARServe(nn.Module):
    """DAR's bottleneck (the weights allhere saved: ``...self_attn.allhere.{down,up}.weight``) and the owner
    of the distant keys' cache."""

    def __init__(self, d_model: int, d_down: int, full: Attention, prefix: str) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, d_down, bias=False)
        self.up = nn.Linear(d_down, d_model, bias=False)
        self.far = Attention(full.num_heads, full.head_size, full.impl.scale, num_kv_heads=full.num_kv_heads,
                             cache_config=get_current_vllm_config().cache_config, prefix=f"{prefix}.{SUBMODULE}.far")


def block_argument(block, args, kwargs, name: str):
    """(where, key) of the attention block's argument ``name`` in this call: ``kwargs`` and the name, or
    ``args`` and its index (families differ: Llama's blocks take (positions, hidden_states), gpt-oss's
    (hidden_states, positions), either by position or by keyword)."""
    if name in kwargs:
        return kwargs, name
    params = [p for p in inspect.signature(type(block).forward).parameters if p != "self"]
    return args, params.index(name)


def _dar_append(block, args, kwargs):
    """Forward pre-hook: the block's input [h; h'] at positions [p; p]."""
    mech = getattr(block, SUBMODULE)
    args, kwargs = list(args), dict(kwargs)
    for name in ("positions", "hidden_states"):
        where, key = block_argument(block, args, kwargs, name)
        where[key] = _doubled(where[key], mech, name)
    return tuple(args), kwargs


def _doubled(x, mech: DARServe, name: str):
    return torch.cat([x, x if name == "positions" else mech.up(mech.down(x))], dim=-1 if name == "positions" else 0)


def _dar_first_half(block, args, output):
    """Forward hook: the output of the real tokens (the first half)."""
    return output[: output.shape[0] // 2]


def install_dar(block: nn.Module, attn: Attention, cfg, d_model: int) -> None:
    params = inspect.signature(type(block).forward).parameters
    if not {"positions", "hidden_states"} <= set(params):
        raise NotImplementedError(f"allhere vLLM serving: DAR needs vLLM's own attention block (taking positions and "
                                  f"hidden_states); {type(block).__name__} runs through vLLM's Transformers backend")
    mech = DARServe(d_model, cfg.d_down, attn, attn.layer_name.rpartition(".")[0])
    block.add_module(SUBMODULE, mech)
    block.attn = PagedAttention([attn, mech.far], dar_choice(cfg.window))
    block.register_forward_pre_hook(_dar_append, with_kwargs=True)
    block.register_forward_hook(_dar_first_half)


def install_masked(block: nn.Module, attn: Attention, cfg) -> None:
    if not getattr(cfg, "causal", True):
        raise NotImplementedError(f"allhere vLLM serving: {cfg.kind} with causal=False is an encoder's pattern")
    block.attn = PagedAttention([attn], masked_choice(cfg.mask_fn(None)))
