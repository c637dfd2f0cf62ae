"""Routing of AA-MoE ("Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin):
which resources each token reads and the log P(i, j_k) bias of Eqs. 10-16. Pure functions of tensors;
``allhere.mechanisms.aamoe`` feeds them.

Resources of token i at position p_i: the context chunks wholly before its own (j < p_i // m) and all E
experts (Eq. 8). Scores (Eq. 4): r_ij = RoPE_{p_i}(W_c^T h_i) . RoPE_{c_j}(h_{c_j}) / sqrt(d) for chunk j,
whose summary is its last token c_j (rotating both sides makes the score depend on the relative position,
what the document asks RoPE for); r_il = h_i . e_l / sqrt(d) for expert l.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BUDGET_EPS = 1e-4  # floor(B b_i + eps): uniform shares of an integer budget are not floored one below it
FLOOR = -80.0  # the lowest argument of exp() in the router's softmax normaliser (see ``_masked_logsumexp``)


@dataclass
class Route:
    """The choice of every token: what the op reads and what the statistics report."""

    choice: torch.Tensor  # [b, n, K] int64 resource (chunks 0.., experts after), -1 = rank unused
    logp: torch.Tensor  # [b, n, K] log P(i, j_k) (differentiable), 0 where unused
    budget: torch.Tensor  # [b, n] int64 B_i = floor(S_i)
    used: torch.Tensor  # [b, n] int64 min(B_i, resources available)
    chunk_base: int  # the op's index of the first expert

    @property
    def chunks(self) -> torch.Tensor:
        """[b, n] int64 context chunks among the chosen."""
        return ((self.choice >= 0) & (self.choice < self.chunk_base)).sum(-1)

    @property
    def experts(self) -> torch.Tensor:
        """[b, n] int64 experts among the chosen."""
        return (self.choice >= self.chunk_base).sum(-1)


def floor_budget(share: torch.Tensor) -> torch.Tensor:
    """B_i = floor(S_i) (int64, no gradient)."""
    return torch.floor(share.detach() + BUDGET_EPS).long()


def sigmoid_input(share: torch.Tensor, mode: str, budget: torch.Tensor | None = None) -> torch.Tensor:
    """What enters sigma(. - k) of Eq. 11: the continuous S_i = B b_i ("continuous"), B_i itself ("floored":
    no gradient reaches w_B), or B_i forward with the continuous gradient ("straight_through"). ``budget``:
    floor_budget(share) when already known."""
    if mode == "continuous":
        return share
    floored = (floor_budget(share) if budget is None else budget).to(share.dtype)
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
    budget = floor_budget(share)
    n_avail = avail.sum(-1)  # [b or 1, n]
    used = torch.minimum(budget, n_avail)
    top_k = int(used.max()) if used.numel() else 0
    masked = r.float().masked_fill(~avail, float("-inf"))
    vals, idx = masked.topk(top_k, dim=-1) if top_k else (masked[..., :0], budget.new_zeros(*r.shape[:2], 0))
    rank = torch.arange(1, top_k + 1, device=r.device)
    valid = rank <= used[..., None]
    if softmax_scope == "available":  # 0 where nothing is available
        lse = _masked_logsumexp(masked, vals[..., :1] if top_k else None).masked_fill((n_avail == 0)[..., None], 0.0)
    else:  # 0 where nothing is chosen
        lse = torch.logsumexp(vals.masked_fill(~valid, float("-inf")), -1, keepdim=True).nan_to_num(neginf=0.0)
    log_choice = torch.where(valid, vals, 0.0) - lse
    afford = F.logsigmoid(sigmoid_input(share.float(), sigmoid_mode, budget)[..., None] - rank)
    logp = torch.where(valid, afford + log_choice, 0.0)
    if chunk_base != n_chunks:  # experts move to the op's indices
        idx = torch.where(idx < n_chunks, idx, idx + (chunk_base - n_chunks))
    return Route(idx.masked_fill(~valid, -1), logp, budget, used, chunk_base)


def _masked_logsumexp(masked: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor:
    """logsumexp over the last dimension of ``masked`` (-inf where unavailable), keepdim; ``top`` the row
    maximum when known. exp() is taken no lower than FLOOR below the maximum (e^-80: nothing next to the
    maximum's 1): CPU exp is many times slower on arguments that underflow, such as the -inf of the mask."""
    top = (masked.amax(-1, keepdim=True) if top is None else top).detach().nan_to_num(neginf=0.0)
    return (masked - top).clamp(min=FLOOR).exp().sum(-1, keepdim=True).log() + top


@functools.lru_cache(maxsize=64)
def rope_table(first: int, n: int, step: int, dim: int, theta: float, device: torch.device):
    """``angle_table`` at positions first, first + step, ..., cached: the same few tables serve every layer
    and step."""
    return angle_table(first + step * torch.arange(n, device=device), dim, theta)


def angle_table(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [n, dim] of the rotary embedding at positions [n] (rotate-half layout, as the host's; an odd
    last dimension is left unrotated: cos 1, sin 0)."""
    half, n = dim // 2, positions.shape[0]
    inv = 1.0 / theta ** (torch.arange(0, 2 * half, 2, device=positions.device, dtype=torch.float32) / dim)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin, rest = ang.cos(), ang.sin(), torch.ones(n, dim - 2 * half, device=positions.device)
    return torch.cat([cos, cos, rest], -1), torch.cat([sin, sin, rest * 0.0], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin in fp32 (cos/sin from ``rope_table``; sin negated rotates back)."""
    x = x.float()
    half = x.shape[-1] // 2
    if x.shape[-1] % 2:
        turned = torch.cat([-x[..., half:2 * half], x[..., :half], x[..., 2 * half:]], -1)
    else:
        x1, x2 = x.chunk(2, -1)
        turned = torch.cat([-x2, x1], -1)
    return x * cos + turned * sin


def rope(x: torch.Tensor, first: int, theta: float, step: int = 1) -> torch.Tensor:
    """Rotary embedding of x [b, n, d] at positions first, first + step, ... (rotate-half layout, as the host's)."""
    return rotate(x, *rope_table(first, x.shape[-2], step, x.shape[-1], theta, x.device))


@functools.lru_cache(maxsize=64)
def availability(first: int, n: int, chunk: int, n_chunks: int, experts: int, device: torch.device) -> torch.Tensor:
    """[1, n, n_chunks + E] bool: the chunks wholly before each token's own chunk, then every expert (cached)."""
    positions = first + torch.arange(n, device=device)
    ctx = torch.arange(n_chunks, device=device)[None, :] < (positions // chunk)[:, None]
    return torch.cat([ctx, ctx.new_ones(n, experts)], -1)[None]


def router_scores(h: torch.Tensor, hq: torch.Tensor, first: int, summaries: torch.Tensor | None,
                  expert_emb: torch.Tensor, chunk: int, theta: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(r [b, n, R], avail [1, n, R], number of routed chunks). h [b, n, d] the tokens' representations at
    positions first, first + 1, ...; hq = h W_c [b, n, d]; summaries [b, C, d] the last token of every
    complete chunk so far (None: context not routed); expert_emb [E, d]."""
    n, d = h.shape[1], h.shape[-1]
    n_chunks = 0 if summaries is None else summaries.shape[1]
    experts = expert_emb.shape[0]
    scale = d ** -0.5  # applied to the smaller side of each product
    parts = []
    if n_chunks:
        keys = rope(summaries, chunk - 1, theta, chunk) * scale
        parts.append(rope(hq, first, theta) @ keys.transpose(1, 2))
    if experts:
        parts.append(h.float() @ (expert_emb.float() * scale).T)
    avail = availability(first, n, chunk, n_chunks, experts, h.device)
    if not parts:
        return h.new_zeros(*h.shape[:2], 0).float(), avail, 0
    return (torch.cat(parts, -1) if len(parts) > 1 else parts[0]), avail, n_chunks
