"""The interface every attention mechanism implements, and what the host layer hands it.

A host attention layer (``allhere.model.Attention`` in our decoder, or a Hugging Face attention module
converted by ``allhere.hf.convert``) projects q, k, v and applies its rotary embedding; the mechanism
decides which keys each query reads and returns the attention output. Everything else a mechanism may
need travels in one ``AttentionCall``. A mechanism brings:

- its config dataclass (frozen, validated, with a ``kind``) and its module class, registered together
  with ``allhere.registry.register``;
- its attention through the entries of the op families (``allhere.ops``), so that ``allhere.use_backend``
  picks their path (``"reference"`` included) for its layers too;
- ``new_cache()``: the KV cache it decodes with (``allhere.mechanisms.caches`` has the common ones);
- ``reset_parameters()``: (re-)initialises what it adds to a pretrained full-attention layer (routers,
  bottlenecks; the constructor calls it); every other weight is the host's and is copied on conversion;
- ``router_parameters()``: parameters trained with the router learning rate and no weight decay;
- ``q_extra_rows``: optional rows appended to the host's query projection (one fused matmul), whose
  outputs arrive as ``call.q_extra``;
- ``routed``: True when it returns per-token routing (``LayerRouting``) and honours ``forced_gate``;
- ``replaces_mlp``: True when it brings the block's feed-forward capacity itself (persistent memory as
  in All-Attention): the host block then has no MLP sublayer (our decoder only);
- ``aux_loss``: a scalar its last forward adds to the training objective (None: nothing), e.g. a budget
  predictor's regression loss; our decoder sums them into ``DecoderOutput.aux_loss`` and
  ``allhere.losses.training_loss`` into the total, so gradient accumulation scales it like the LM loss;
- on Hugging Face models, either transformers' own KV cache (``hf_cache = True``: every key kept) or a
  cache layer of its own, which the host builds (``allhere.hf.cache``: DAR's compressed cache; a
  mechanism defined outside allhere may bring one, ``new_hf_cache_layer()``);
- ``host_softmax``: True when it computes its attention through the host's own (``AttentionCall.attend``)
  where the host's softmax has terms of its own (attention sinks, soft-capped scores);
- context parallelism (``allhere.distributed.context``: one sequence split across ranks, attention through
  the ring): ``context_parallel_plan(call, n)`` returns a ``ContextParallelPlan`` -- which keys each query
  reads, as mask predicates on absolute positions, optionally a per-(token, head) gate between two of them
  and a function of the block's scores, optionally keys that travel in a compact form (``FarKV``: DAR's
  latents); a mechanism that cannot run so leaves it out, and
  ``context_parallel_refusal()`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..masks import Mask, MaskFn


@dataclass
class LayerRouting:
    """What a routed mechanism decided in one forward pass (``allhere.routing.Routing`` gathers the layers')."""

    scores: torch.Tensor  # [batch, heads, tokens] router scores s in (0, 1) (fp32, differentiable)
    gates: torch.Tensor  # [batch, heads, tokens] bool hard gates, True = full attention


@dataclass(frozen=True)
class AttentionDims:
    """Sizes of the host attention layer."""

    d_model: int  # width of the block input x
    n_heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when fewer than n_heads)
    head_dim: int  # channels per head


@dataclass
class AttentionCall:
    """What the host hands its mechanism besides q [b, h, n, d] and k, v [b, kv_heads, n, d]."""

    x: torch.Tensor  # [b, n, d_model] the attention block's input (after the block's norm)
    segment_starts: torch.Tensor | None = None  # [b, n] first key of each query's segment, -1 = sees nothing
    scale: float | None = None  # softmax scale; None = 1 / sqrt(head_dim)
    q_extra: torch.Tensor | None = None  # [b, n, rows] outputs of the mechanism's ``q_extra_rows``
    # int64 [n]: the absolute positions of the new tokens (queries) in their sequence; None = they follow
    # the cache (from 0 without one). Given for a shard of a longer sequence (``Decoder(positions=...)``).
    positions: torch.Tensor | None = None
    # project_kv(h, positions=None) -> (k, v): other inputs through the host's own K/V path (projection,
    # norms, rotary at ``positions``, by default the new tokens'), in our decoder and on HF models alike.
    project_kv: Callable | None = None
    kv_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # (W_K, W_V) where the host's K/V are plain linear maps
    # attend(q, k, v, allowed) -> [b, h, n, d]: the host's own attention under a bool mask ``allowed`` [b, h or 1,
    # n, kv], given where its softmax has more than scaled scores (gpt-oss's sink logits, Gemma-2's soft-capping);
    # a mechanism that honours it (``host_softmax``) attends through it, and no other may be installed there.
    attend: Callable | None = None
    # int [b]: one decode query per sequence over keys in a longer buffer (a host's static cache), sequence i
    # holding its first kv_len[i]; only a mechanism with ``takes_kv_len`` is handed one.
    kv_len: torch.Tensor | None = None
    # (cos, sin) [n, rot] or [b, n, rot]: the host's rotary embedding of the queries (rotate-half layout over the
    # first ``rot`` <= head_dim channels, pair f = channels (f, f + rot/2); the rest unrotated), None where the
    # host rotates otherwise. A mechanism that needs the queries' unrotated part (``dar_latent``) inverts it.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ContextParallelPlan:
    """What one call of a mechanism computes, in the terms the ring (context parallelism) runs on.

    The ring splits the sequence of n tokens into chunks held by different ranks. For every (query chunk,
    key chunk) block it asks the predicates whether any score is kept: a block none is kept in is skipped
    with its transfer, one where only gated rows read it computes only those rows, others every row. Each
    block's softmax attention (output and log-sum-exp) is merged exactly by log-sum-exp, forward and backward.
    """

    # (b, h, q_idx, kv_idx) -> bool on absolute positions (an ``allhere.masks.Mask``, or a plain predicate): the
    # keys a query reads (with a gate: where the gate is set). A mask's ``tiles`` test lets the ring skip blocks
    # cheaply; without one it evaluates the predicate over each block once.
    reads: Mask | MaskFn
    local: Mask | MaskFn | None = None  # with a gate: the keys read where the gate is not set (a subset of ``reads``)
    # [b, h, n / world]: per (token, head) of this rank's shard, 1 = ``reads``, 0 = ``local``; a bool gate, or
    # a 0/1 float gate whose gradient is the straight-through one of ``allhere.ops.ste``.
    gate: torch.Tensor | None = None
    routing: object = None  # what the layer returns beside its output (``LayerRouting`` of the shard's tokens)
    # scores(q, k, q_pos, k_pos, scale) -> [b, h, m, c]: the logits of one block, q [b, h, m, dim] and k [b, h,
    # c, dim] in fp32 (k already repeated to the query heads), q_pos [b|1, h|1, m, 1] and k_pos [1, 1, 1, c]
    # their absolute positions. None: (q @ k^T) * scale. Any differentiable function of q and k; the ring
    # masks, normalises and merges it, and gets its gradient by autograd on the block.
    scores: Callable | None = None
    # keys read in a compact form that the receiving rank expands (DAR's d_down latents): see ``FarKV``. None:
    # every key travels as the host's full-dimensional K/V.
    far: FarKV | None = None


@dataclass
class FarKV:
    """Keys and values a query reads in a compact form, for a ``ContextParallelPlan``: the keys of
    ``reads`` outside ``near`` are not the host's K/V but ``expand(payload, positions)`` of a small payload
    per token, so a rank sends another only the payload of a chunk it reads that way (d_small numbers per
    token instead of 2 x kv_heads x head_dim), plus the full K/V of a chunk only where some query of the
    receiver reads it through ``near``. The receiver expands the payload itself; gradients flow back through
    ``expand`` into the payload's owner (and into the weights ``expand`` uses, on the receiver).
    """

    # [b, n / world, d_small]: this rank's payload, one row per token of its shard (DAR: c = h W_down),
    # differentiable in whatever produced it.
    payload: torch.Tensor
    # expand(payload [b, m, d_small], positions int64 [m]) -> (k, v) [b, kv_heads, m, head_dim]: the K/V a query
    # reads for these tokens outside ``near``, given their positions (DAR: the host's K/V path at h' = c W_up,
    # RoPE at those positions): absolute ones, or [b, m] rotary positions that restart with every document
    # where the host's do (packed documents on a Hugging Face model). Any differentiable function, the same
    # on every rank.
    expand: Callable
    # (b, h, q_idx, kv_idx) -> bool on absolute positions: the keys of ``reads`` read through the host's own
    # (full-dimensional) K/V, e.g. the window; None: none, every key read is expanded.
    near: Mask | MaskFn | None = None


class AttentionMechanism(nn.Module):
    """Base class of every mechanism module. Subclasses set ``routed``, override ``forward`` and, where
    they add weights or keep a special cache, ``reset_parameters`` / ``router_parameters`` / ``new_cache``."""

    routed = False  # returns LayerRouting and honours ``forced_gate``
    reads_all_keys = True  # without routing: whether every query reads every preceding token (mu_f 1 or 0)
    hf_support = True  # whether ``allhere.hf.convert`` may install it in a Hugging Face attention module
    hf_cache = True  # whether it decodes with transformers' own KV cache (every key kept) on HF models
    host_softmax = False  # whether it attends through ``AttentionCall.attend`` when the host gives one
    takes_kv_len = False  # whether it decodes over a static cache buffer (``AttentionCall.kv_len``)
    replaces_mlp = False  # whether the host block drops its MLP (the mechanism holds the feed-forward memory)
    aux_loss: torch.Tensor | None = None  # a scalar loss of the last forward for the training objective

    def __init__(self, cfg, dims: AttentionDims) -> None:
        super().__init__()
        self.cfg = cfg
        self.dims = dims

    @property
    def q_extra_rows(self) -> torch.Tensor | None:
        return None

    def reset_parameters(self) -> None:
        """(Re-)initialise the mechanism's own weights; nothing by default."""

    def router_parameters(self) -> list[nn.Parameter]:
        return []

    @classmethod
    def init_from_host(cls, model: nn.Module, run: Callable[[], object] | None = None) -> None:
        """After a conversion of pretrained ``model``: set the weights of every layer of this class from the host
        layers' pretrained weights (``run``: forward passes over calibration text, or None). Nothing by default
        (AHA's open routers and DAR's orthonormal bottleneck need no host weights); ``has_host_init`` tells."""

    @classmethod
    def host_init_refusal(cls, host: nn.Module) -> str | None:
        """Why the host attention module ``host`` cannot give ``init_from_host`` its weights, or None."""
        return None

    @classmethod
    def has_host_init(cls) -> bool:
        """Whether ``init_from_host`` reads the host's weights (then it needs them materialised, not on meta)."""
        return cls.init_from_host.__func__ is not AttentionMechanism.init_from_host.__func__

    def new_cache(self):
        from .caches import KVCache

        return KVCache()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, cache=None):
        """Returns (out [b, h, n, d], LayerRouting or None). With ``cache`` the new k, v are added to it
        first and the queries are the last n positions of everything cached."""
        raise NotImplementedError

    def context_parallel_plan(self, call: AttentionCall, n: int) -> ContextParallelPlan:
        """What this call computes when the sequence of ``n`` tokens is split across ranks (``call`` is the
        rank's shard: ``call.x`` and ``call.q_extra`` hold its tokens, ``call.positions`` their absolute
        positions). Must equal what ``forward`` computes on the whole sequence. Not implemented by default."""
        raise NotImplementedError(f"{type(self).__name__} cannot run context-parallel: "
                                  f"{self.context_parallel_refusal()}")

    def context_parallel_refusal(self) -> str | None:
        """None when this module runs under context parallelism, otherwise the reason it cannot (one line).
        By default: supported exactly when the class implements ``context_parallel_plan``."""
        if type(self).context_parallel_plan is AttentionMechanism.context_parallel_plan:
            return "it does not implement context_parallel_plan"
        return None


def mechanism_layers(model: nn.Module) -> list[AttentionMechanism]:
    """Every mechanism module of a model (our decoder or a converted Hugging Face model), in layer order."""
    return [m for m in model.modules() if isinstance(m, AttentionMechanism)]
