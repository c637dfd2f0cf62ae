"""Mechanism ``all_attention``: the All-Attention layer of "Augmenting Self-attention with Persistent
Memory" (Sukhbaatar et al. 2019, arXiv:1907.01470).

Each query head owns ``n_mem`` persistent key/value vectors M_k, M_v (learned, independent of the input)
that are concatenated to the context's keys and values: K = [K_ctx; M_k], V = [V_ctx; M_v] (Eqs. 2-3 of
"Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin). One softmax runs
over the causal context and every memory slot, so the memory plays the part of the feed-forward
sublayer, which the host block drops (``replaces_mlp``).

The persistent vectors carry no position. The host hands queries rotated by RoPE at their absolute
position p, so q_p . m would depend on p (a different feed-forward function at every position, and
angles never seen in training when evaluating longer sequences). ``memory_positions = "relative"``
(default) reads the memory with the query rotated back (R(-p) q_p . m = q . m: the memory is the same
at every position, as a feed-forward sublayer is); "absolute" uses the rotated query as given. The
rotation back assumes what our decoder does: RoPE with base ``rope_theta`` at the positions of the keys
(query i of the last lq of lk keys at lk - lq + i, or at ``AttentionCall.positions`` when given). With
``segment_starts`` the context is masked per segment; the memory stays visible to every query (a padding
query then reads only the memory, never NaN). Cache: the context's K/V in an ordinary ``KVCache``; the
memory is a constant of the layer. The attention itself is op family ``"all_attention"``
(``allhere.ops.all_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..backend import dispatch
from ..ops.common import segment_mask
from ..registry import register
from ..validation import check, check_int, is_number
from .base import AttentionCall, AttentionDims, AttentionMechanism

MEMORY_POSITIONS = ("relative", "absolute")


@dataclass(frozen=True)
class AllAttentionConfig:
    """Persistent memory of ``n_mem`` key/value slots per query head in place of the feed-forward sublayer.

    Initialisation: keys with std head_dim^-1/2 (unit-norm keys, so a memory logit is of the order of a
    context logit), values with std n_mem^-1/2 (a uniform read of the memory has the scale of one value).
    """

    n_mem: int = 256  # N: persistent key/value vectors per head
    memory_positions: str = "relative"  # "relative": memory read without the query's rotation; "absolute"
    rope_theta: float = 10000.0  # the host's RoPE base (to rotate queries back for the memory)

    kind: str = field(default="all_attention", init=False)

    def __post_init__(self) -> None:
        check_int("AllAttentionConfig", "n_mem", self.n_mem, 1)
        check(self.memory_positions in MEMORY_POSITIONS, "AllAttentionConfig", "memory_positions",
              self.memory_positions, f"one of {MEMORY_POSITIONS}")
        check(is_number(self.rope_theta) and self.rope_theta > 0, "AllAttentionConfig", "rope_theta",
              self.rope_theta, "a finite number > 0")


def unrotate_queries(q: torch.Tensor, kv_len: int, theta: float,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, h, lq, d] rotated by RoPE (rotate-half layout, base ``theta``) at ``positions`` [lq] (default:
    kv_len - lq + i, the last lq of kv_len keys), rotated back to position 0."""
    d, lq = q.shape[-1], q.shape[2]
    pos = (kv_len - lq + torch.arange(lq, device=q.device) if positions is None else positions).float()
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=q.device, dtype=torch.float32) / d)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    x1, x2 = q.float().chunk(2, dim=-1)
    return (q.float() * ang.cos() - torch.cat([-x2, x1], dim=-1) * ang.sin()).to(q.dtype)


@register(AllAttentionConfig, summary="All-Attention: persistent memory slots replace the feed-forward sublayer")
class AllAttention(AttentionMechanism):
    """Causal attention over the context and ``n_mem`` persistent key/value vectors per head; no MLP."""

    replaces_mlp = True
    hf_support = False  # a Hugging Face block cannot drop its MLP

    def context_parallel_refusal(self) -> str:
        return "its persistent memory slots are keys outside the sequence, which the ring does not carry"

    def __init__(self, cfg: AllAttentionConfig, dims: AttentionDims) -> None:
        super().__init__(cfg, dims)
        self.mem_k = nn.Parameter(torch.empty(dims.n_heads, cfg.n_mem, dims.head_dim))
        self.mem_v = nn.Parameter(torch.empty(dims.n_heads, cfg.n_mem, dims.head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.mem_k.normal_(0.0, self.dims.head_dim ** -0.5)
            self.mem_v.normal_(0.0, self.cfg.n_mem ** -0.5)

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        if cache is not None:
            k, v = cache.update(k, v)
        mask = None
        if call.segment_starts is not None:
            mask = segment_mask(call.segment_starts, q.shape[2], k.shape[2])
        relative = self.cfg.memory_positions == "relative"
        q_mem = unrotate_queries(q, k.shape[2], self.cfg.rope_theta, call.positions) if relative else q
        return dispatch("all_attention", q, k, v, self.mem_k, self.mem_v, call.scale, mask, q_mem), None
