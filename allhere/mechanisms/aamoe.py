"""Mechanism ``aamoe``: AA-MoE, from "Attention Is All You Need 2: Seriously, All We Are Using Is
Attention" (Ohad Rubin): one attention layer that reads, per token, a budget of resources shared between
context chunks (conditional context, as in MoBA, arXiv:2502.13189) and experts (persistent memory slots as
in All-Attention, "Augmenting Self-attention with Persistent Memory", arXiv:1907.01470). It replaces
both the attention and the feed-forward sublayer (``replaces_mlp``).

The sequence is cut into chunks of m tokens; the memory into E experts of m key/value slots per head.
Token i gets B_i = floor(B b_i) resources, b_i = softmax over the sequence of w_B^T h_i and B = beta L
(``budget`` = beta, resources per token on average). It reads the top-B_i of the chunks before its own
and the experts by router score (``aamoe_route``); all heads share the choice; a chosen chunk contributes
the host's keys/values of its m tokens (post-RoPE, as the host computed them), an expert its m slots
directly. Each resource's keys get the bias log P(i, j_k) = log sigmoid(S_i - k) + log softmax(r_i)_{j_k}
(Eqs. 10-16); the op is ``allhere.ops.aamoe``.

Decisions the document leaves open (each a config field, see ``AAMoEConfig`` and docs/aamoe.md):
own chunk, what enters the sigmoid, the scope of the router softmax, B_i = 0, the causal predictor.

Budgets come from the whole sequence (``budget_source = "sequence"``, training) or from the causal
predictor (``"predictor"``, for generation and honest perplexity); decoding with a cache always uses the
predictor. ``set_budget_source``/``set_budget_scale`` switch every AA-MoE layer of a model. With
``record = True`` a layer keeps the statistics of its last forward in ``stats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.aamoe import aamoe_attention
from ..registry import register
from ..validation import check, check_int, is_number
from .aamoe_budget import BudgetPredictor, prefix_log_share, sequence_log_share
from .aamoe_cache import AAMoECache
from .aamoe_route import angle_table, choose, floor_budget, rope_table, rotate, router_scores
from .allattention import MEMORY_POSITIONS
from .base import AttentionCall, AttentionDims, AttentionMechanism

OWN_CHUNK = ("always", "never")
SIGMOID_BUDGET = ("continuous", "floored", "straight_through")
ROUTER_SOFTMAX = ("available", "chosen")
PREDICTORS = ("learned", "prefix")
BUDGET_SOURCES = ("sequence", "predictor")
REFERENCE_GONE = "AAMoEAttention.reference is gone: run the dense reference with allhere.use_backend('reference')"


@dataclass(frozen=True)
class AAMoEConfig:
    """AA-MoE: a per-token budget of resources (previous context chunks and experts) read by attention.

    Decisions (reasons in docs/aamoe.md):
      - ``own_chunk``: "always" (default; as MoBA) every token also reads its own chunk causally, outside
        the budget and without a log P term: the document's chunk router needs the chunk's last token,
        which the earlier tokens of the chunk cannot see, so the own chunk cannot be routed causally, and
        a byte model without its nearest tokens is crippled. "never": the document's Eq. 8 literally
        (previous chunks and experts only; a B_i = 0 token then reads nothing).
      - ``sigmoid_budget``: "continuous" (default) puts S_i = B b_i in sigmoid(S_i - k), as the
        document's own example (budget 2.5) does, and is the only way w_B gets a gradient; "floored" uses
        B_i (w_B then never learns); "straight_through" B_i forward, the continuous gradient backward.
      - ``router_softmax``: "available" (default) normalises r over every available resource (the text
        of Eq. 14: "sum over all the items available to the buyer"), so routing learns which resources to
        prefer even at B_i = 1; "chosen" over the B_i chosen ones (Eq. 14's index l over j_1..j_Bi).
      - B_i = 0 (and any token that reads nothing): the attention output is 0, the residual passes through.
      - ``predictor``: the causal budget of generation and perplexity, "learned" (default, MoD-style MLP)
        or "prefix" (the softmax normaliser over the past), see ``aamoe_budget``.
      - ``budget`` is per token (B = budget x L): a sequence twice as long gets twice the total budget.
      - expert keys and values are separate slots (M_k, M_v of All-Attention), not one shared vector.
      - ``memory_positions``: "relative" (default) reads expert slots with the query rotated back to
        position 0, so an expert computes the same function at every position (as a feed-forward layer;
        see ``allattention``); "absolute" uses the host's rotated query.
    """

    chunk: int = 16  # m: tokens per context chunk and slots per expert
    experts: int = 16  # E (0: context only)
    budget: float = 2.0  # beta: resources per token on average (B = beta L)
    route_context: bool = True  # False: experts only (the own chunk still as ``own_chunk`` says)
    own_chunk: str = "always"  # "always" | "never"
    sigmoid_budget: str = "continuous"  # "continuous" | "floored" | "straight_through"
    router_softmax: str = "available"  # "available" | "chosen"
    predictor: str = "learned"  # "learned" | "prefix"
    predictor_hidden: int = 64  # hidden width of the learned predictor
    predictor_trains_trunk: bool = False  # let the predictor's loss reach the representations it reads
    predictor_weight: float = 0.1  # weight of the predictor's loss in the training loss
    memory_positions: str = "relative"  # expert slots read by the query rotated back ("absolute": as given)
    rope_theta: float = 10000.0  # the host's RoPE base: the router's rotary embedding and the rotation back

    kind: str = field(default="aamoe", init=False)

    def __post_init__(self) -> None:
        c = "AAMoEConfig"
        check_int(c, "chunk", self.chunk, 1)
        check_int(c, "experts", self.experts, 0)
        check(is_number(self.budget) and self.budget > 0, c, "budget", self.budget, "a finite number > 0")
        check(isinstance(self.route_context, bool), c, "route_context", self.route_context, "True or False")
        check(self.route_context or self.experts > 0, c, "experts", self.experts,
              ">= 1 when route_context is False (else there is nothing to route)")
        check(self.own_chunk in OWN_CHUNK, c, "own_chunk", self.own_chunk, f"one of {OWN_CHUNK}")
        check(self.sigmoid_budget in SIGMOID_BUDGET, c, "sigmoid_budget", self.sigmoid_budget,
              f"one of {SIGMOID_BUDGET}")
        check(self.router_softmax in ROUTER_SOFTMAX, c, "router_softmax", self.router_softmax,
              f"one of {ROUTER_SOFTMAX}")
        check(self.predictor in PREDICTORS, c, "predictor", self.predictor, f"one of {PREDICTORS}")
        check_int(c, "predictor_hidden", self.predictor_hidden, 1)
        check(isinstance(self.predictor_trains_trunk, bool), c, "predictor_trains_trunk",
              self.predictor_trains_trunk, "True or False")
        check(is_number(self.predictor_weight) and self.predictor_weight >= 0, c, "predictor_weight",
              self.predictor_weight, "a finite number >= 0")
        check(self.memory_positions in MEMORY_POSITIONS, c, "memory_positions", self.memory_positions,
              f"one of {MEMORY_POSITIONS}")
        check(is_number(self.rope_theta) and self.rope_theta > 0, c, "rope_theta", self.rope_theta,
              "a finite number > 0")


@register(AAMoEConfig, summary="AA-MoE: a per-token budget shared between context chunks and experts")
class AAMoEAttention(AttentionMechanism):
    """Runtime switches: ``budget_source`` ("sequence" | "predictor"), ``budget_scale`` (B x scale),
    ``record`` (keep ``stats`` of the last forward). The op's path follows ``allhere.use_backend``."""

    replaces_mlp = True
    hf_support = False  # a Hugging Face block cannot drop its MLP
    reads_all_keys = False

    def context_parallel_refusal(self) -> str:
        return ("each token reads the chunks and experts its router picks within a budget set over the whole "
                "sequence, not a fixed mask of positions the ring can plan")

    def __init__(self, cfg: AAMoEConfig, dims: AttentionDims) -> None:
        super().__init__(cfg, dims)
        d, h, e, m = dims.d_model, dims.n_heads, cfg.experts, cfg.chunk
        self.w_c = nn.Linear(d, d, bias=False)  # W_c of the chunk router (Eq. 4)
        self.expert_emb = nn.Parameter(torch.empty(e, d))  # e_l (Eq. 4)
        self.w_b = nn.Linear(d, 1, bias=False)  # w_B of the budget
        self.mem_k = nn.Parameter(torch.empty(h, e, m, dims.head_dim))  # expert key slots per head
        self.mem_v = nn.Parameter(torch.empty(h, e, m, dims.head_dim))  # expert value slots per head
        self.predictor = BudgetPredictor(d, cfg.predictor_hidden) if cfg.predictor == "learned" else None
        self.budget_source, self.budget_scale, self.record = "sequence", 1.0, False
        self.stats: dict | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Router scores of unit scale at the start (W_c std d^-1/2, e_l std 1, r scaled by d^-1/2);
        w_B = 0 (uniform budgets); expert keys std head_dim^-1/2, values std (E m)^-1/2 (as All-Attention)."""
        d = self.dims.d_model
        with torch.no_grad():
            self.w_c.weight.normal_(0.0, d ** -0.5)
            self.expert_emb.normal_(0.0, 1.0)
            self.w_b.weight.zero_()
            self.mem_k.normal_(0.0, self.dims.head_dim ** -0.5)
            self.mem_v.normal_(0.0, max(1, self.cfg.experts * self.cfg.chunk) ** -0.5)
        if self.predictor is not None:
            self.predictor.reset_parameters()

    def router_parameters(self) -> list[nn.Parameter]:
        params = [self.w_c.weight, self.expert_emb, self.w_b.weight]
        return params + ([] if self.predictor is None else list(self.predictor.parameters()))

    def new_cache(self) -> AAMoECache:
        return AAMoECache(self.cfg.chunk)

    @property
    def reference(self):
        raise AttributeError(REFERENCE_GONE)

    @reference.setter
    def reference(self, value):
        raise AttributeError(REFERENCE_GONE)

    def log_shares(self, x: torch.Tensor, u: torch.Tensor, cache: AAMoECache | None) -> torch.Tensor:
        """The causal predictor's t_i = log(L b_i) estimate [b, n]."""
        if self.predictor is not None:
            return self.predictor(x if self.cfg.predictor_trains_trunk else x.detach())
        if cache is None:
            return prefix_log_share(u)
        before, seen = cache.update_normaliser(u)
        return prefix_log_share(u, before, seen)

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        cfg, x = self.cfg, call.x
        if call.segment_starts is not None:
            raise ValueError("aamoe does not take segment_starts (padded or packed batches): its budget is "
                             "shared by the whole sequence; pass one unpadded sequence per row")
        if cache is None:
            summaries = x[:, cfg.chunk - 1::cfg.chunk]  # the last token of every complete chunk
        else:
            k, v, summaries = cache.update(k, v, x)
        n, lk = x.shape[1], k.shape[2]
        u = self.w_b(x).squeeze(-1).float()
        source = "predictor" if cache is not None else self.budget_source
        beta = cfg.budget * self.budget_scale
        t_seq = sequence_log_share(u) if source == "sequence" else None
        t_pred = self.log_shares(x, u, cache) if (source == "predictor" or self.predictor is not None
                                                  or self.record) else None
        share = beta * torch.exp(t_seq if source == "sequence" else t_pred)
        hq = self.w_c(x)
        r, avail, n_routed = router_scores(x, hq, lk - n, summaries if cfg.route_context else None,
                                           self.expert_emb, cfg.chunk, cfg.rope_theta)
        route = choose(r, avail, share, n_routed, -(-lk // cfg.chunk), cfg.sigmoid_budget, cfg.router_softmax)
        relative = cfg.memory_positions == "relative"  # the rotation of the queries as the host applied it
        q_mem = unrotate(q, lk - n, cfg.rope_theta, call.positions) if relative else None
        out = aamoe_attention(q, k, v, self.mem_k, self.mem_v, route.choice, route.logp, cfg.chunk,
                              cfg.own_chunk == "always", call.scale, q_mem)
        self.aux_loss = None
        if (source == "sequence" and self.predictor is not None and self.training and torch.is_grad_enabled()
                and cfg.predictor_weight > 0):
            self.aux_loss = cfg.predictor_weight * F.mse_loss(t_pred, t_seq.detach())
        if self.record:
            self.stats = self._stats(route, lk - n + torch.arange(n, device=x.device), share, t_pred, beta)
        return out, None

    def _stats(self, route, positions, share, t_pred, beta) -> dict:
        own = (positions % self.cfg.chunk + 1) if self.cfg.own_chunk == "always" else torch.zeros_like(positions)
        stats = {"budget": route.budget, "used": route.used, "chunks": route.chunks, "experts": route.experts,
                 "keys": route.used * self.cfg.chunk + own[None], "share": share.detach(),
                 "n_chunks_seen": (positions // self.cfg.chunk)[None].expand_as(route.used)}
        if t_pred is not None:
            stats["predicted_budget"] = floor_budget(beta * torch.exp(t_pred))
        return stats


def unrotate(q: torch.Tensor, first: int, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, h, n, d] rotated by RoPE (rotate-half layout, base ``theta``) at positions first, first + 1, ...
    (or at ``positions`` [n]), rotated back to position 0: the queries that read the experts (as
    ``allattention.unrotate_queries``, with the cached tables of ``aamoe_route.rope_table``)."""
    n, d = q.shape[-2:]
    cos, sin = rope_table(first, n, 1, d, theta, q.device) if positions is None else angle_table(positions, d, theta)
    return rotate(q, cos, -sin).to(q.dtype)


def aamoe_layers(model) -> list[AAMoEAttention]:
    return [m for m in model.modules() if isinstance(m, AAMoEAttention)]


def set_budget_source(model, source: str) -> None:
    """"sequence" (budgets from the whole sequence, as trained) or "predictor" (causal) on every AA-MoE layer."""
    if source not in BUDGET_SOURCES:
        raise ValueError(f"budget source must be one of {BUDGET_SOURCES}, got {source!r}")
    for m in aamoe_layers(model):
        m.budget_source = source


def set_budget_scale(model, scale: float) -> None:
    """Evaluate every AA-MoE layer at budget B x ``scale`` (1 restores the trained budget)."""
    if not (is_number(scale) and scale > 0):
        raise ValueError(f"budget scale must be a finite number > 0, got {scale!r}")
    for m in aamoe_layers(model):
        m.budget_scale = float(scale)


def set_record(model, on: bool) -> None:
    for m in aamoe_layers(model):
        m.record, m.stats = on, None
