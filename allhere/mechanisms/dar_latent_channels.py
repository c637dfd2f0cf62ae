"""Which head channels a ``dar_latent`` layer keeps rotated for distant keys, and its initialisation from a
pretrained host's W_K / W_V: the recipe of MHA2MLA ("Towards Economical Inference: Enabling DeepSeek's
Multi-Head Latent Attention in Any Transformer-based LLMs", arXiv:2502.14837) -- partial RoPE by the "2-norm"
score, then a joint truncated SVD of [W_K,nope ; W_V].

Channels of a head of width d under a rotate-half rotary embedding of width rot <= d: pair f < rot/2 is the
channels (f, f + rot/2), rotated together by frequency f; channels rot..d-1 are never rotated. A layer keeps
``rope_pairs`` pairs per KV head (``channel_order``: [kept pair channels, then the content channels]); a query
reads the far keys in that order, its kept pairs as the host rotated them and the rest unrotated (``far_queries``).

Pure functions of tensors: no host is named (``dar_latent_init.init_from_host`` finds the weights).
"""

from __future__ import annotations

import torch


def pair_norms(x: torch.Tensor, rot: int) -> torch.Tensor:
    """[b, heads, n, d] -> [heads, rot/2]: the sum over tokens of each rotary pair's 2-norm (the rotation
    leaves it unchanged, so rotated and unrotated states give the same)."""
    half = rot // 2
    x = x[..., :rot].float()
    return torch.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2).sum(dim=(0, 2))


def weight_pair_norms(w: torch.Tensor, heads: int, rot: int) -> torch.Tensor:
    """[heads * head_dim, d] projection -> [heads, rot/2]: each rotary pair's Frobenius norm of its two rows,
    which is what ``pair_norms`` measures for inputs of identity covariance (a data-free stand-in)."""
    w = w.detach().float().view(heads, -1, w.shape[-1])[:, :rot]
    half = rot // 2
    return torch.sqrt((w[:, :half] ** 2).sum(-1) + (w[:, half:] ** 2).sum(-1))


def two_norm_scores(q_sums: torch.Tensor, k_sums: torch.Tensor, tokens: int) -> torch.Tensor:
    """MHA2MLA's 2-norm score per (KV head, pair): mean_t ||q_f|| x mean_t ||k_f||, summed over the query heads
    of the group. q_sums [heads, P], k_sums [kv_heads, P] from ``pair_norms``; returns [kv_heads, P]."""
    g = k_sums.shape[0]
    q = (q_sums / tokens).view(g, -1, q_sums.shape[-1])
    return (q * (k_sums / tokens)[:, None]).sum(1)


def uniform_pairs(kv_heads: int, n_pairs: int, keep: int) -> torch.Tensor:
    """The choice without calibration data nor a W_Q (MHA2MLA's uniform selection): ``keep`` pairs evenly spaced over
    the frequencies, highest first; the same for every KV head. int64 [kv_heads, keep]."""
    if keep == 0:
        return torch.zeros(kv_heads, 0, dtype=torch.long)
    picked = torch.linspace(0, n_pairs - 1, keep).round().long().unique()
    if picked.numel() < keep:  # fewer distinct rounds than asked: fill with the first pairs not taken
        rest = [f for f in range(n_pairs) if f not in set(picked.tolist())]
        picked = torch.cat([picked, torch.tensor(rest[:keep - picked.numel()], dtype=torch.long)]).sort().values
    return picked.expand(kv_heads, keep).clone()


def top_pairs(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` highest-scoring pairs of every KV head (scores [kv_heads, P]), ascending. int64."""
    return scores.topk(keep, dim=-1).indices.sort(dim=-1).values


def channel_order(pairs: torch.Tensor, rot: int, head_dim: int) -> torch.Tensor:
    """int64 [kv_heads, head_dim]: per KV head its kept pairs' channels (f..., then f + rot/2...), then every
    other channel ascending (the content part)."""
    rows = []
    for kept in pairs.tolist():
        first = kept + [f + rot // 2 for f in kept]
        rows.append(first + [c for c in range(head_dim) if c not in set(first)])
    return torch.tensor(rows, dtype=torch.long).view(pairs.shape[0], head_dim)


def svd_init(w_k: torch.Tensor, w_v: torch.Tensor, order: torch.Tensor, kept: int, d_c: int):
    """(W_down [d_c, d], W_UK [kv_heads * e_c, d_c], W_UV [kv_heads * head_dim, d_c]) from the host's W_K, W_V
    ([kv_heads * head_dim, d], before the rotary embedding): the truncated SVD of [W_K's content rows ; W_V] =
    U S V^T gives W_down = V^T (orthonormal rows) and [W_UK ; W_UV] = U S, so c W_UK^T and c W_UV^T are the best
    rank-d_c approximations of the host's content keys and values (exact when d_c >= the stack's rank; the
    spare rows of W_down stay zero). ``kept``: the leading rotated channels of each row of ``order``."""
    g, d = order.shape
    rows = (order[:, kept:] + torch.arange(g)[:, None] * d).reshape(-1)
    stack = torch.cat([w_k.float()[rows], w_v.float()])
    u, s, vh = torch.linalg.svd(stack, full_matrices=False)
    r = min(d_c, s.numel())
    down = torch.zeros(d_c, w_k.shape[1])
    up = torch.zeros(stack.shape[0], d_c)
    down[:r], up[:, :r] = vh[:r], u[:, :r] * s[:r]
    return down, up[:rows.numel()], up[rows.numel():]


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, d] rotated by a rotate-half embedding of width rot = cos.shape[-1] (cos, sin [n, rot] or
    [b, n, rot]) -> x before it: R^T x = x cos - rotate_half(x) sin. Where the embedding scales cos and sin by s
    (YaRN's attention factor) this gives s^2 x_pre, the factor the host's scores carry. Channels past rot pass."""
    rot = cos.shape[-1]
    cos, sin = (t.float().reshape(-1, 1, *t.shape[-2:]) for t in (cos, sin))  # [b or 1, 1, n, rot]
    r = x[..., :rot].float()
    r1, r2 = r.chunk(2, dim=-1)
    out = r * cos - torch.cat([-r2, r1], dim=-1) * sin
    return torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


def in_channel_order(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d] -> its channels in ``channels`` [kv_heads, d] order (each head by its KV head's row)."""
    b, heads, n, _ = x.shape
    index = channels.repeat_interleave(heads // channels.shape[0], dim=0)
    return x.gather(-1, index[None, :, None].expand(b, heads, n, -1))


def far_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, channels: torch.Tensor,
                r2: int) -> torch.Tensor:
    """The queries of the far keys, [q^R ; q^C]: q [b, heads, n, d] as the host rotated it (cos, sin: its
    rotary table at the queries' positions, as ``unrotate`` takes them) -> [b, heads, n, d] in ``channels``
    order, the first ``r2`` channels (the kept pairs) as they are, the others unrotated: the queries every host
    reads the far keys with."""
    return torch.cat([in_channel_order(q, channels)[..., :r2], in_channel_order(unrotate(q, cos, sin),
                                                                                channels)[..., r2:]], dim=-1)
