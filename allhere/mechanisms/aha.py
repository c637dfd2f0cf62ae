"""All-or-Here attention (seeds/003): a router per layer picks full or windowed attention per (token, head).

S = sigmoid(X W_router) on the attention block's input X (Eq. 1); g = 1[s > tau] (Eq. 2); the forward
pass uses exactly g, the backward pass treats the threshold as the identity (straight-through, Eq. 3);
a = full causal attention where g = 1, the ``window`` most recent keys where g = 0 (Eq. 4).

Cache policy: every key is kept (any later token may go global); a local (token, head) reads only its
window. Grouped-query attention: the gate is per *query* head; a kv head's whole cache is read when any
of the query heads sharing it is global, and only its window otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import AHAConfig
from ..masks import segment_starts
from ..ops.aha import aha_attention_fast, aha_attention_naive
from ..routing import LayerRouting
from .full import KVCache

IMPLS = {"fast": aha_attention_fast, "naive": aha_attention_naive}


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


def straight_through(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Value: the hard gate 1[s > tau] (as float); gradient: identity to the scores (Eq. 3)."""
    hard = (scores > tau).to(scores.dtype)
    return hard + (scores - scores.detach())


class AHAAttention(nn.Module):
    """Mechanism ``aha``.

    ``forced_gate``: None routes normally; True / False forces every gate to full / local attention; a
    bool tensor [heads] fixes each head (the static baseline). ``impl``: "fast" (default) or "naive".
    """

    def __init__(self, cfg: AHAConfig, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads = n_heads
        self.forced_gate: bool | torch.Tensor | None = None
        self.impl = "fast"
        if cfg.router == "linear":
            self.router = nn.Linear(d_model, n_heads, bias=cfg.router_bias)
        else:  # "qproj": the logits arrive as extra q_proj channels; only the bias lives here
            self.router_bias = nn.Parameter(torch.zeros(n_heads)) if cfg.router_bias else None
        self.reset_router()

    def reset_router(self, qproj_rows: torch.Tensor | None = None) -> None:
        """Initialise the router as ``cfg.router_init`` says; for router="qproj" pass the q_proj rows."""
        if self.cfg.router == "linear":
            init_router_(self.router.weight, self.router.bias, self.cfg)
        else:
            rows = torch.empty(self.n_heads, 1) if qproj_rows is None else qproj_rows
            init_router_(rows, self.router_bias, self.cfg)

    def new_cache(self) -> KVCache:
        return KVCache()

    def scores(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Router scores s = sigmoid(X W_router) in fp32, [batch, heads, tokens]."""
        if self.cfg.router == "linear":
            logits = self.router(x)
        else:
            if router_logits is None:
                raise ValueError("router='qproj' needs the router logits split off the q projection")
            logits = router_logits if self.router_bias is None else router_logits + self.router_bias
        return torch.sigmoid(logits.float()).transpose(1, 2)

    def forward(self, q, k, v, x, cache=None, router_logits=None, scale=None, mask=None):
        """q [b, h, n, d], k/v [b, kv_heads, n, d] (new tokens), x [b, n, d_model] the block input.

        mask: optional bool [b, 1 or h, n, kv_len] of keys each query may see at all. The mask of a padded
        batch or of packed documents (causal within segments, ``segment_starts``) runs the fast op with
        each query's segment start; any other mask, or impl "naive", the dense reference.
        Returns (out [b, h, n, d], LayerRouting)."""
        s = self.scores(x, router_logits)
        hard = s > self.cfg.tau
        if self.forced_gate is not None:
            forced = torch.as_tensor(self.forced_gate, device=hard.device)
            hard = forced.view(1, -1, 1).expand_as(hard) if forced.dim() else torch.full_like(hard, bool(forced))
            gate = hard
        elif torch.is_grad_enabled() and s.requires_grad:
            gate = straight_through(s, self.cfg.tau)
        else:
            gate = hard
        if cache is not None:
            k, v = cache.update(k, v)
        starts = None if mask is None or self.impl != "fast" else segment_starts(mask, q.shape[2], k.shape[2])
        if mask is None:
            out = IMPLS[self.impl](q, k, v, gate, self.cfg.window, scale=scale)
        elif starts is not None:
            out = aha_attention_fast(q, k, v, gate, self.cfg.window, scale=scale, row_start=starts)
        else:
            out = aha_attention_naive(q, k, v, gate, self.cfg.window, scale=scale, mask=mask)
        return out, LayerRouting(scores=s, gates=hard)
