"""Dense reference of DAR with distant keys scored in the latent (op family ``"dar_latent"``): the far keys and
values are built explicitly from the latent and the rotated key, and one softmax covers the window's exact keys
and the far ones, in fp32. The ground truth of the absorbed and rebuilt paths."""

from __future__ import annotations

import torch

from ...masks.predicates import causal, dense_mask
from ...masks.windows import sliding_window
from ..common import default_scale, repeat_kv
from .check import check_latent_call, split_rows


def far_keys(latent: torch.Tensor, k_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The far keys the latent form stands for: [k_rope ; c W_UK_g^T] of KV head g, [b, kv_heads, lk, e_r + e_c],
    in the latent's dtype."""
    k_c = torch.einsum("blc,gec->bgle", latent, w_uk.to(latent.dtype))
    return torch.cat([k_rope.to(latent.dtype), k_c], dim=-1)


def far_kv(latent: torch.Tensor, k_rope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
    """The far keys (``far_keys``) and values c W_UV_g^T of KV head g, each [b, kv_heads, lk, .], in the latent's
    dtype (fp32 for fp32 inputs)."""
    return far_keys(latent, k_rope, w_uk), torch.einsum("blc,gdc->bgld", latent, w_uv.to(latent.dtype))


def dar_latent_attention_reference(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int,
                                   scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Query i reads key j (j <= i) as the host's (k_near, v_near) when i - j < window, else through the latent:
    score q_far_i . [k_rope_j ; c_j W_UK_g^T] and value c_j W_UV_g^T (g: the query head's KV head); one softmax
    over both, one scale.

    q [b, h, lq, d]: the host's (rotated) queries; q_far [b, h, lq, e_r + e_c]: the queries of the far keys,
    [rotated part ; unrotated content part]; k_near, v_near [b, kv_heads, ln, d]: the host's K/V of the last ln
    of the lk positions (all of them, or at least the window of every query: ln >= lq + window - 1); rows
    [b, lk, d_c + kv_heads x e_r]: each position's latent c and its rotated keys k_rope of every KV head
    (``check.pack_rows``); w_uk [kv_heads, e_c, d_c]; w_uv [kv_heads, d, d_c]. Queries are the last lq of the lk
    positions. window = 0: every key is far. mask: optional bool, broadcastable to [b, h, lq, lk], True = may
    attend; a query that may see no key gives 0. scale: None = 1 / sqrt(d). Returns q's dtype."""
    _, h, lq, d, _, lk = check_latent_call(q, q_far, k_near, v_near, rows, w_uk, w_uv, window)
    scale = default_scale(d, scale)
    k_near, v_near = (torch.nn.functional.pad(t, (0, 0, lk - t.shape[2], 0)) for t in (k_near, v_near))
    allowed = dense_mask(causal, lq, lk, q.device) if mask is None else dense_mask(causal, lq, lk, q.device) & mask
    near = dense_mask(sliding_window(window), lq, lk, q.device) if window > 0 else torch.zeros_like(allowed)
    latent, k_rope = split_rows(rows.float(), k_near.shape[1], w_uk.shape[2])
    k_far, v_far = (repeat_kv(t, h) for t in far_kv(latent, k_rope, w_uk.float(), w_uv.float()))
    logits = torch.where(near, q.float() @ repeat_kv(k_near, h).float().transpose(-1, -2),
                         q_far.float() @ k_far.transpose(-1, -2)) * scale  # one grid: each key near or far
    logits = logits.masked_fill(~allowed, float("-inf"))
    seen = allowed.any(-1, keepdim=True)
    p = torch.where(seen, torch.softmax(logits.masked_fill(~seen, 0.0), dim=-1), 0.0)
    out = (p * near) @ repeat_kv(v_near, h).float() + (p * ~near) @ v_far
    return out.to(q.dtype)
