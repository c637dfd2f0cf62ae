"""Mechanism ``aha``: All-or-Here attention, from "Learning When Not to Attend Globally" (Luo, Zhang, Yan).

A router per layer scores every (token, head): S = sigmoid(X W_router) on the attention block's input X
(Eq. 1); the hard gate g = 1[s > tau] (Eq. 2) sends the head to full causal attention (g = 1) or to its
``window`` most recent keys (g = 0, Eq. 4). The forward pass uses exactly g; the backward pass treats the
threshold as the identity (straight-through, Eq. 3); training adds lambda * mean(S) to the loss (Eq. 6).

Cache policy: every key is kept (any later token may go global); a local (token, head) reads only its
window. Grouped-query attention: the gate is per *query* head; a kv head's whole cache is read when any
of the query heads sharing it is global, and only its window otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..masks import causal
from ..ops.aha import aha_attention
from ..ops.sliding.reference import local_pattern
from ..ops.ste import straight_through
from ..registry import Serving, register
from ..validation import check, check_int, is_number
from .aha_gate import router_scores
from .base import AttentionCall, AttentionDims, AttentionMechanism, ContextParallelPlan, LayerRouting

ROUTER_KINDS = ("linear", "qproj")
ROUTER_INITS = ("global", "neutral", "local")


@dataclass(frozen=True)
class AHAConfig:
    """All-or-Here attention: per (token, head) a hard gate picks full or windowed attention.

    Router initialisation (``router_init``):
      - ``"global"``: W_router = 0 and bias = +``router_init_bias`` (default 3, score ~0.95 > tau), so every
        gate starts open and a converted model computes exactly what the pretrained full-attention model
        computed; the L1 penalty then closes the gates that the language-model loss does not defend. This
        is the default because fine-tuning starts from the pretrained model's quality.
      - ``"neutral"``: W_router ~ N(0, 0.02), bias 0: scores near 0.5, about half the gates open at random.
      - ``"local"``: W_router = 0 and bias = -``router_init_bias``: starts as a sliding-window model and
        opens gates only where the loss asks for it.
    The paper's router has no bias (S = sigmoid(X W)); ``router_bias=False`` gives exactly that, and then
    "global"/"local" initialise with W = 0 (scores 0.5, every gate closed since the gate is s > tau).
    ``router="qproj"`` computes the same router as extra output rows of the host's query projection (one
    fused matmul instead of two); the rows are the router's own parameters, trained like the linear one.

    Sinks (``sinks``, beyond the paper): a local (token, head) also reads the first ``sinks`` tokens of its
    sequence (of its segment in a padded or packed batch), as StreamingLLM keeps them ("Efficient Streaming
    Language Models with Attention Sinks", arXiv:2309.17453). Pretrained models park attention on their first
    token; a window that drops it loses most of what the model computes (SmolLM2-135M at w = 128: 61.8% of its
    quality with every head local, 91.8% with the first token kept). mu_f keeps its meaning: the share of
    (token, head) pairs that read the whole prefix. 0 (the default) is the paper's AHA.
    """

    window: int = 256  # w: a local (token, head) sees its w most recent keys, itself included
    sinks: int = 0  # and the first `sinks` tokens of its sequence (0: the paper's AHA; see the class docstring)
    tau: float = 0.5  # threshold of the hard gate g = 1[s > tau] (Eq. 2)
    lam: float = 3e-4  # lambda, weight of L_reg = mean router score (Eqs. 6-7)
    router: str = "linear"  # "linear": separate W_router (d x m); "qproj": m extra rows fused into q_proj
    router_bias: bool = True  # add a learned bias to the router logits (not in the paper's Eq. 1)
    router_init: str = "global"  # "global" | "neutral" | "local", see the class docstring
    router_init_bias: float = 3.0  # magnitude of the initial bias for "global"/"local"

    kind: str = field(default="aha", init=False)

    def __post_init__(self) -> None:
        c = "AHAConfig"
        check_int(c, "window", self.window, 1)
        check_int(c, "sinks", self.sinks, 0)
        check(self.sinks < self.window, c, "sinks", self.sinks, f"fewer than window = {self.window}")
        check(is_number(self.tau) and 0.0 < self.tau < 1.0, c, "tau", self.tau, "a number strictly between 0 and 1")
        check(is_number(self.lam) and self.lam >= 0.0, c, "lam", self.lam, "a finite number >= 0")
        check(self.router in ROUTER_KINDS, c, "router", self.router, f"one of {ROUTER_KINDS}")
        check(isinstance(self.router_bias, bool), c, "router_bias", self.router_bias, "True or False")
        check(self.router_init in ROUTER_INITS, c, "router_init", self.router_init, f"one of {ROUTER_INITS}")
        check(is_number(self.router_init_bias) and self.router_init_bias >= 0.0, c, "router_init_bias",
              self.router_init_bias, "a finite number >= 0")


def init_router_(weight: torch.Tensor, bias: torch.Tensor | None, cfg: AHAConfig) -> None:
    """Initialise router weights [heads, d] and bias [heads] in place (see ``AHAConfig``)."""
    with torch.no_grad():
        if cfg.router_init == "neutral":
            weight.normal_(0.0, 0.02)
        else:
            weight.zero_()
        if bias is not None:
            sign = {"global": 1.0, "local": -1.0, "neutral": 0.0}[cfg.router_init]
            bias.fill_(sign * cfg.router_init_bias)


# served (allhere.serve): the router and allhere's attention over vLLM's paged cache, the host's sink logits and
# soft cap included; on CUDA through allhere's Triton paged kernel, whose launch grids follow each step's lengths
# (no CUDA graphs)
@register(AHAConfig, summary="All-or-Here: a router picks full or windowed attention per (token, head)",
          serving=Serving("aha", devices=("cpu", "cuda"), softmax_terms=True, cuda_graphs=False))
class AHAAttention(AttentionMechanism):
    """``forced_gate``: None routes normally; True / False forces every gate to full / local attention; a
    bool tensor [heads] fixes each head (the static baseline); a bool tensor [batch, heads, tokens] fixes each
    (token, head) of the next call (a teacher's oracle gates)."""

    routed = True
    host_softmax = True
    takes_kv_len = True

    def __init__(self, cfg: AHAConfig, dims: AttentionDims) -> None:
        super().__init__(cfg, dims)
        self.forced_gate: bool | torch.Tensor | None = None
        heads = dims.n_heads
        if cfg.router == "linear":
            self.router = nn.Linear(dims.d_model, heads, bias=cfg.router_bias)
        else:
            self.q_router = nn.Parameter(torch.empty(heads, dims.d_model))
            self.router_bias = nn.Parameter(torch.zeros(heads)) if cfg.router_bias else None
        self.reset_parameters()

    @property
    def q_extra_rows(self) -> torch.Tensor | None:
        return self.q_router if self.cfg.router == "qproj" else None

    def reset_parameters(self) -> None:
        if self.cfg.router == "linear":
            init_router_(self.router.weight, self.router.bias, self.cfg)
        else:
            init_router_(self.q_router, self.router_bias, self.cfg)

    def router_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def scores(self, x: torch.Tensor, q_extra: torch.Tensor | None = None) -> torch.Tensor:
        """Router scores s = sigmoid(X W_router) in fp32, [batch, heads, tokens]."""
        if self.cfg.router == "linear":
            logits = self.router(x)
        else:
            if q_extra is None:
                raise ValueError("router='qproj' needs its logits from the host's fused query projection")
            logits = q_extra if self.router_bias is None else q_extra + self.router_bias
        return router_scores(logits.transpose(1, 2))  # not a view: FSDP2 warns of views among outputs

    def gate(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate for the op, hard bool gate): the straight-through gate while training the router."""
        hard = s > self.cfg.tau
        if self.forced_gate is not None:
            forced = torch.as_tensor(self.forced_gate, device=hard.device)
            if forced.dim() == 3:  # per (sequence, head, token): exactly this call's gates (an oracle's)
                if forced.shape != hard.shape:
                    raise ValueError(f"a forced gate per (sequence, head, token) must be {tuple(hard.shape)}, got "
                                     f"{tuple(forced.shape)}")
                hard = forced.bool()
            else:
                hard = forced.view(1, -1, 1).expand_as(hard) if forced.dim() else torch.full_like(hard, bool(forced))
            return hard, hard
        if torch.is_grad_enabled() and s.requires_grad:
            return straight_through(s, self.cfg.tau), hard
        return hard, hard

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        s = self.scores(call.x, call.q_extra)
        gate, hard = self.gate(s)
        if cache is not None:
            k, v = cache.update(k, v)
        # a host whose softmax has terms of its own (call.attend): both attentions through it, on the reference
        out = aha_attention(q, k, v, gate, self.cfg.window, scale=call.scale, row_start=call.segment_starts,
                            attend=call.attend, kv_len=call.kv_len, sinks=self.cfg.sinks)
        return out, LayerRouting(scores=s, gates=hard)

    def context_parallel_plan(self, call: AttentionCall, n: int) -> ContextParallelPlan:
        """The router scores and gates the shard's own tokens (its input is per token); the ring then reads
        the whole causal prefix for the global (token, head) pairs and the window for the others, and gives
        the straight-through gate the gradient of the one-process op while the router trains."""
        s = self.scores(call.x, call.q_extra)
        gate, hard = self.gate(s)
        return ContextParallelPlan(reads=causal, local=local_pattern(self.cfg.window, self.cfg.sinks), gate=gate,
                                   routing=LayerRouting(scores=s, gates=hard))
