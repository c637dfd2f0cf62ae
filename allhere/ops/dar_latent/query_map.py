"""The far queries of a decode step as absorbed cache rows, in one matmul from the host's rotated queries.

``mechanisms.dar_latent_channels.far_queries`` then ``check.query_rows`` take about twenty small tensor operations
per layer (the rotation undone, the channels reordered per KV head, W_UK applied, q^R put in its KV head's slot).
At batch 1 a served step's cost is its number of operations, so the served decode folds all of it into two parts:

- per step (shared by a model's layers, which rotate with one table): the rotary factors at the queries'
  positions, so that the unrotated query is u = q * C + q[perm] * S (rotate-half: R^T q = q cos - rotate_half(q) sin);
- per layer (built once from its weights): M_g [2 d, d_c + kv_heads x e_r] with [q ; u] @ M_g = the query row
  [u^C W_UK_g ; q^R in slot g]: the kept channels taken from q as rotated, the content channels from u through W_UK.
"""

from __future__ import annotations

import torch


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, sin [n, rot / 2] (a rotate-half table's halves at n positions), head size d >= rot -> (C, S [n, 1, d]
    fp32, perm [d]) with R^T q = q * C + q[..., perm] * S; channels past rot pass unchanged."""
    n, half = cos.shape
    rest = d - 2 * half
    one, zero = cos.new_ones(n, rest, dtype=torch.float32), cos.new_zeros(n, rest, dtype=torch.float32)
    cos, sin = cos.float(), sin.float()
    c = torch.cat([cos, cos, one], -1)[:, None]
    s = torch.cat([sin, -sin, zero], -1)[:, None]
    perm = torch.cat([torch.arange(half, 2 * half), torch.arange(half), torch.arange(2 * half, d)]).to(cos.device)
    return c, s, perm


def query_map(channels: torch.Tensor, w_uk: torch.Tensor, e_r: int) -> torch.Tensor:
    """channels [kv_heads, d] (per KV head: the e_r kept rotated channels, then the content ones, as
    ``far_queries`` orders them), w_uk [kv_heads, d - e_r, d_c] -> M [kv_heads, 2 d, d_c + kv_heads x e_r] fp32."""
    g, d = channels.shape
    d_c = w_uk.shape[2]
    m = torch.zeros(g, 2 * d, d_c + g * e_r, device=w_uk.device)
    for h in range(g):
        kept, content = channels[h, :e_r].long(), channels[h, e_r:].long()
        m[h, kept, d_c + h * e_r + torch.arange(e_r, device=m.device)] = 1.0
        m[h, d + content, :d_c] = w_uk[h].float()
    return m


def absorbed_queries(q: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], m: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """q [n, heads, d] as the host rotated it, ``factors`` = ``rotary_factors`` at its positions, m = ``query_map``
    -> the query rows [n, heads, d_c + kv_heads x e_r] in ``dtype`` (= ``query_rows(far_queries(q))``)."""
    n, heads, d = q.shape
    c, s, perm = factors
    qf = q.float()
    u = torch.addcmul(qf * c, qf.index_select(-1, perm), s)
    x = torch.cat([qf, u], -1).view(n, m.shape[0], heads // m.shape[0], 2 * d)
    return by_kv_head(x, m).to(dtype).reshape(n, heads, -1)


def by_kv_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, kv_heads, q, e] @ w [kv_heads, e, out] per KV head -> [n, kv_heads, q, out], in one bmm. Not matmul,
    which broadcasts w to every n (a copy each), nor einsum, whose planning costs 3x the bmm at a decode step's
    sizes (16 us against 5 us on one core)."""
    n, g, q, e = x.shape
    return torch.bmm(x.transpose(0, 1).reshape(g, n * q, e), w).view(g, n, q, -1).transpose(0, 1)
