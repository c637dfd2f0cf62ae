"""What each served mechanism puts on a converted vLLM attention block: its rule for ``PagedAttention``
(``allhere.serve.vllm.attention``) and the weights and hooks it needs, put there by ``install`` (which runs the
installer a kind's ``Serving`` names). Each takes the kind's config object (``allhere.registry.from_dict``), and
the mechanisms' own pure pieces give the rules: AHA's gate from the hidden state
(``allhere.mechanisms.aha_gate.hidden_gate``), a pattern's mask predicate (``cfg.mask_fn``).

- AHA: one attention over the layer's cache, two row classes: a local (token, head) reads its ``window`` most
  recent keys (and its request's first ``sinks`` tokens, ``AHAConfig.sinks``: one ``window_read`` holding both), a
  global one every earlier key, in prefill (chunked prefill included) as in decode. The router
  ``S = sigmoid(X W_router + b)`` on the block's input X (the weights allhere saved,
  ``...self_attn.allhere.router.{weight,bias}``) gives the gate per (token, query head) in a forward pre-hook.
  The host's softmax terms are kept: learned sink logits (gpt-oss) and soft-capped scores (Gemma-2). Where
  vLLM's CPU kernel reads allhere's block layout, the local rows and a decode token's global rows are its kernel's
  (in place, over the same blocks: ``allhere.serve.vllm.cpu_kernels.aha_over_vllm``) and allhere's attention computes
  the prefill tokens' global rows; with one sink the decode tokens' windows stay vLLM's (the sink swapped in for
  the call) and allhere's attention computes the prefill tokens' local rows; with more, every row.
  The layer's cache keeps every key either way (its vLLM spec is full attention: the global rows read them all).
- sinks, dilated, Longformer, BigBird and any other causal pattern (``install_masked``): one class reading what
  the pattern's predicate allows.
- DAR: ``allhere.serve.vllm.dar``.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention

from ...hosts import SUBMODULE
from ...mechanisms.aha_gate import hidden_gate
from ...ops.paged.attention import Read, causal_read, window_read
from .attention import WIDE_TILE, WINDOW_TILE, PagedAttention
from .blocks import block_argument


class AHAServe(nn.Module):
    """AHA's router for one layer (``cfg``: the kind's ``AHAConfig``), and its routing counts; ``gate`` is set by
    the block's pre-hook."""

    def __init__(self, cfg, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.tau = cfg.tau
        if cfg.router != "linear":
            raise NotImplementedError(f"allhere vLLM serving: AHA router={cfg.router!r} is not supported "
                                      "(use 'linear')")
        # in float32 whatever the served dtype: the gate is a threshold on its scores, and a CPU's bfloat16 matmul
        # of one token by a few heads costs several times float32's
        self.router = nn.Linear(d_model, n_heads, bias=cfg.router_bias, dtype=torch.float32)
        self.gate: torch.Tensor | None = None
        self.forced_gate: bool | None = None  # True / False: every gate global / local; None: route
        self.register_buffer("n_global", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("n_pairs", torch.zeros((), dtype=torch.long), persistent=False)

    def route(self, x: torch.Tensor) -> None:
        """x [tokens, d_model] (vLLM's own blocks) or [1, tokens, d_model] (Hugging Face modules under vLLM's
        Transformers backend): the attention block's input. Sets the hard gate [tokens, heads]."""
        _, gate = hidden_gate(x.reshape(-1, x.shape[-1]).float(), self.router.weight, self.router.bias, self.tau,
                              self.forced_gate)
        self.gate = gate
        self.n_global += gate.sum()
        self.n_pairs += gate.numel()


def _route_hook(block, args, kwargs):
    where, key = block_argument(block, args, kwargs, "hidden_states")
    getattr(block, SUBMODULE).route(where[key])


def install_aha(block: nn.Module, attn: Attention, cfg, d_model: int, n_heads: int) -> AHAServe:
    mech = AHAServe(cfg, d_model, n_heads)
    block.add_module(SUBMODULE, mech)
    local = window_read(cfg.window, q_tile=WINDOW_TILE, n_sinks=cfg.sinks)  # the window, and the sinks if any
    reads = [[local], [causal_read(q_tile=WIDE_TILE)]]  # gate 0 / 1
    block.attn = PagedAttention(attn, reads, router=mech, window_class=0)
    block.register_forward_pre_hook(_route_hook, with_kwargs=True)
    return mech


def install_masked(block: nn.Module, attn: Attention, cfg) -> None:
    """Any pattern: its config's ``mask_fn(n, layer)`` (a causal predicate with its block test) over the cache."""
    if not callable(getattr(cfg, "mask_fn", None)):
        raise NotImplementedError(f"allhere vLLM serving: {cfg.kind} is served as a masked pattern, but "
                                  f"{type(cfg).__name__} has no mask_fn")
    if not getattr(cfg, "causal", True):
        raise NotImplementedError(f"allhere vLLM serving: {cfg.kind} with causal=False is an encoder's pattern")
    block.attn = PagedAttention(attn, [[Read(pattern_mask(cfg), WINDOW_TILE)]])


_MASKS: dict = {}  # config -> its Mask, made once


def pattern_mask(cfg):
    """``cfg.mask_fn(None)``, one object for every layer of an equal config (a frozen dataclass): a decode step's
    reads of it are then worked out by its first layer and kept for the others (``ops.paged.decode.decode_direct``
    with the step's ``PagedStepPlan``)."""
    try:
        if cfg not in _MASKS:
            _MASKS[cfg] = cfg.mask_fn(None)
        return _MASKS[cfg]
    except TypeError:  # a config that cannot be a key: a mask of its own
        return cfg.mask_fn(None)
