"""What each served mechanism puts on a converted vLLM attention block: its rule for ``PagedAttention``
(``allhere.serve.vllm_paged``) and the weights and hooks it needs. Imported by ``allhere.serve.vllm_model``,
never by ``import allhere``. The mechanisms' own pure pieces give the rules: AHA's gate from the hidden state
(``allhere.mechanisms.aha.hidden_gate``), a pattern's mask predicate (``cfg.mask_fn``), DAR's far-key map
(``allhere.mechanisms.dar.far_keys``).

- AHA: one attention over the layer's cache, two row classes: a local (token, head) reads its ``window`` most
  recent keys, a global one every earlier key, in prefill (chunked prefill included) as in decode. The router
  ``S = sigmoid(X W_router + b)`` on the block's input X (the weights allhere saved,
  ``...self_attn.allhere.router.{weight,bias}``) gives the gate per (token, query head) in a forward pre-hook.
  The host's softmax terms are kept: learned sink logits (gpt-oss) and soft-capped scores (Gemma-2). Where
  vLLM's CPU kernel reads allhere's block layout, the local rows are its windowed kernel's (in place, over the
  same blocks) and allhere's attention computes the global rows only.
- sinks, dilated, Longformer, BigBird (causal): one class reading what the pattern's predicate allows.
- DAR: near keys (the window) from the layer's cache, far keys from a second cache of K/V rebuilt from the
  bottleneck, h' = (h W_down) W_up, through the host's own K/V path: a forward pre-hook appends h' to the
  block's input (the same positions again), so the host's projections, norms and rotary embedding make both
  in one pass; the first half of the tokens is the real one, the second gives the far K/V, stored in
  ``...self_attn.allhere.far`` with the same block table; a forward hook drops the second half of the
  block's output. This keeps both sets, twice the plain model's KV bytes (DAR's saving needs a cache of
  d_down latents, and the far K/V rebuilt every step).

Query tiles: rows that read a window go in tiles of 64 (their keys span the tile plus the window); rows that
read every earlier key in tiles of 256 (the keys they gather are shared by more rows).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention

from ..hosts import SUBMODULE
from ..mechanisms.aha import hidden_gate
from ..mechanisms.dar import far_keys
from .paged import Read, causal_read, window_read
from .vllm_paged import PagedAttention

WINDOW_TILE, WIDE_TILE = 64, 256  # query rows per tile: rows reading a window, rows reading every earlier key


class AHAServe(nn.Module):
    """AHA's router for one layer, and its routing counts; ``gate`` is set by the block's pre-hook."""

    def __init__(self, settings: dict, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.window, self.tau = int(settings["window"]), float(settings["tau"])
        if settings.get("router", "linear") != "linear":
            raise NotImplementedError("allhere vLLM serving: AHA router='qproj' is not supported (use 'linear')")
        self.router = nn.Linear(d_model, n_heads, bias=bool(settings.get("router_bias", True)))
        self.gate: torch.Tensor | None = None
        self.forced_gate: bool | None = None  # True / False: every gate global / local; None: route
        self.register_buffer("n_global", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("n_pairs", torch.zeros((), dtype=torch.long), persistent=False)

    def route(self, x: torch.Tensor) -> None:
        """x [tokens, d_model] (vLLM's own blocks) or [1, tokens, d_model] (Hugging Face modules under vLLM's
        Transformers backend): the attention block's input. Sets the hard gate [tokens, heads]."""
        _, gate = hidden_gate(x.reshape(-1, x.shape[-1]), self.router.weight, self.router.bias, self.tau,
                              self.forced_gate)
        self.gate = gate
        self.n_global += gate.sum()
        self.n_pairs += gate.numel()


def block_argument(block, args, kwargs, name: str):
    """(where, key) of the attention block's argument ``name`` in this call: ``kwargs`` and the name, or
    ``args`` and its index (families differ: Llama's blocks take (positions, hidden_states), gpt-oss's
    (hidden_states, positions), either by position or by keyword)."""
    if name in kwargs:
        return kwargs, name
    params = [p for p in inspect.signature(type(block).forward).parameters if p != "self"]
    return args, params.index(name)


def _route_hook(block, args, kwargs):
    where, key = block_argument(block, args, kwargs, "hidden_states")
    getattr(block, SUBMODULE).route(where[key])


def install_aha(block: nn.Module, attn: Attention, settings: dict, d_model: int, n_heads: int) -> AHAServe:
    mech = AHAServe(settings, d_model, n_heads)
    block.add_module(SUBMODULE, mech)
    reads = [[window_read(mech.window, q_tile=WINDOW_TILE)], [causal_read(q_tile=WIDE_TILE)]]  # gate 0 / 1
    block.attn = PagedAttention([attn], reads, softmax_terms=True, router=mech, window_class=(0, mech.window))
    block.register_forward_pre_hook(_route_hook, with_kwargs=True)
    return mech


def install_masked(block: nn.Module, attn: Attention, cfg) -> None:
    if not getattr(cfg, "causal", True):
        raise NotImplementedError(f"allhere vLLM serving: {cfg.kind} with causal=False is an encoder's pattern")
    block.attn = PagedAttention([attn], [[Read(cfg.mask_fn(None), 0, WINDOW_TILE)]])


class DARServe(nn.Module):
    """DAR's bottleneck (the weights allhere saved: ``...self_attn.allhere.{down,up}.weight``) and the owner
    of the distant keys' cache."""

    def __init__(self, d_model: int, d_down: int, full: Attention, prefix: str) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, d_down, bias=False)
        self.up = nn.Linear(d_down, d_model, bias=False)
        self.far = Attention(full.num_heads, full.head_size, full.impl.scale, num_kv_heads=full.num_kv_heads,
                             cache_config=get_current_vllm_config().cache_config, prefix=f"{prefix}.{SUBMODULE}.far")


def _dar_append(block, args, kwargs):
    """Forward pre-hook: the block's input [h; h'] at positions [p; p]."""
    mech = getattr(block, SUBMODULE)
    args, kwargs = list(args), dict(kwargs)
    for name in ("positions", "hidden_states"):
        where, key = block_argument(block, args, kwargs, name)
        x = where[key]
        where[key] = torch.cat([x, x if name == "positions" else mech.up(mech.down(x))],
                               dim=-1 if name == "positions" else 0)
    return tuple(args), kwargs


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
    near = [window_read(cfg.window, 0, q_tile=WINDOW_TILE)] if cfg.window else []
    block.attn = PagedAttention([attn, mech.far], [near + [Read(far_keys(cfg.window), 1, WIDE_TILE)]])
    block.register_forward_pre_hook(_dar_append, with_kwargs=True)
    block.register_forward_hook(_dar_first_half)
