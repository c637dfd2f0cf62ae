"""Routing of AA-MoE ("Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin):
which resources each token reads and the log P(i, j_k) bias of Eqs. 10-16. Pure functions of tensors;
``allhere.mechanisms.aamoe`` feeds them.

Resources of token i at position p_i: the context chunks wholly before its own (j < p_i // m) and all E
experts (Eq. 8). Scores (Eq. 4): r_ij = RoPE_{p_i}(W_c^T h_i) . RoPE_{c_j}(h_{c_j}) / sqrt(d) for chunk j,
whose summary is its last token c_j (rotating both sides makes the score depend on the relative position,
what the document asks RoPE for); r_il = h_i . e_l / sqrt(d) for expert l.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BUDGET_EPS = 1e-4  # floor(B b_i + eps): uniform shares of an integer budget are not floored one below it


@dataclass
class Route:
    """The choice of every token: what the op reads and what the statistics report."""

    choice: torch.Tensor  # [b, n, K] int64 resource (chunks 0.., experts after), -1 = rank unused
    logp: torch.Tensor  # [b, n, K] log P(i, j_k) (differentiable), 0 where unused
    budget: torch.Tensor  # [b, n] int64 B_i = floor(S_i)
    used: torch.Tensor  # [b, n] int64 min(B_i, resources available)
    chunks: torch.Tensor  # [b, n] int64 context chunks among the chosen
    experts: torch.Tensor  # [b, n] int64 experts among the chosen


def floor_budget(share: torch.Tensor) -> torch.Tensor:
    """B_i = floor(S_i) (int64, no gradient)."""
    return torch.floor(share.detach() + BUDGET_EPS).long()


def sigmoid_input(share: torch.Tensor, mode: str) -> torch.Tensor:
    """What enters sigma(. - k) of Eq. 11: the continuous S_i = B b_i ("continuous"), B_i itself ("floored":
    no gradient reaches w_B), or B_i forward with the continuous gradient ("straight_through")."""
    floored = floor_budget(share).to(share.dtype)
    if mode == "continuous":
        return share
    if mode == "floored":
        return floored
    return floored + share - share.detach()


def choose(r: torch.Tensor, avail: torch.Tensor, share: torch.Tensor, n_chunks: int, chunk_base: int,
           sigmoid_mode: str, softmax_scope: str) -> Route:
    """Top-B_i resources per token and their log P.

    r [b, n, R] router scores over R = n_chunks routed chunks followed by the experts; avail [b or 1, n, R]
    bool; share [b, n] the continuous budget S_i. ``chunk_base``: the op's index of the first expert
    (the number of chunks of the key sequence; routed chunk j keeps index j). ``softmax_scope``:
    "available" normalises r over every available resource, "chosen" over the B_i chosen only.
    """
    avail = avail.expand_as(r)
    budget = floor_budget(share)
    used = torch.minimum(budget, avail.sum(-1))
    top_k = int(used.max()) if used.numel() else 0
    masked = r.float().masked_fill(~avail, float("-inf"))
    vals, idx = masked.topk(top_k, dim=-1) if top_k else (masked[..., :0], avail.new_zeros(*r.shape[:2], 0).long())
    rank = torch.arange(1, top_k + 1, device=r.device)
    valid = rank <= used[..., None]
    any_avail = avail.any(-1, keepdim=True)
    if softmax_scope == "available":
        lse = torch.logsumexp(masked, -1, keepdim=True)
    else:
        lse = torch.logsumexp(vals.masked_fill(~valid, float("-inf")), -1, keepdim=True)
    lse = torch.where(torch.isfinite(lse) & any_avail, lse, 0.0)
    log_choice = torch.where(valid, vals, 0.0) - lse
    afford = F.logsigmoid(sigmoid_input(share.float(), sigmoid_mode)[..., None] - rank)
    logp = torch.where(valid, afford + log_choice, 0.0)
    is_chunk = idx < n_chunks
    choice = torch.where(is_chunk, idx, idx - n_chunks + chunk_base).masked_fill(~valid, -1)
    return Route(choice, logp, budget, used, (is_chunk & valid).sum(-1), (~is_chunk & valid).sum(-1))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [b, n, d] at positions [n] (rotate-half layout, as the host's)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d - d % 2, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    half = inv.shape[0]
    x1, x2, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def router_scores(h: torch.Tensor, hq: torch.Tensor, positions: torch.Tensor, summaries: torch.Tensor | None,
                  expert_emb: torch.Tensor, chunk: int, theta: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(r [b, n, R], avail [1, n, R], number of routed chunks). h [b, n, d] the tokens' representations,
    hq = h W_c [b, n, d]; positions [n]; summaries [b, C, d] the last token of every complete chunk so
    far (None: context not routed); expert_emb [E, d]."""
    d = h.shape[-1]
    parts, avail = [], []
    n_chunks = 0 if summaries is None else summaries.shape[1]
    if n_chunks:
        cpos = torch.arange(n_chunks, device=h.device) * chunk + chunk - 1
        parts.append(rope(hq, positions, theta) @ rope(summaries, cpos, theta).transpose(1, 2))
        avail.append(torch.arange(n_chunks, device=h.device)[None, :] < (positions // chunk)[:, None])
    if expert_emb.shape[0]:
        parts.append(h.float() @ expert_emb.float().T)
        avail.append(torch.ones(len(positions), expert_emb.shape[0], dtype=torch.bool, device=h.device))
    if not parts:
        return h.new_zeros(*h.shape[:2], 0).float(), torch.zeros(1, len(positions), 0, dtype=torch.bool), 0
    return torch.cat(parts, -1) * d ** -0.5, torch.cat(avail, -1)[None], n_chunks
