"""The argument check of the ``"dar_latent"`` op family (one place for every path) and the layout of its cache
rows: token j's row is [c_j ; k^R_j of KV head 0 ; ... ; of KV head G - 1] (d_c + G x e_r numbers), as the
caches store it, so the decode reads one contiguous matrix."""

from __future__ import annotations

import torch

from ..common import check_qkv


def check_latent_call(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int):
    """Validate the layout (see ``dar_latent_attention_reference``); return (b, h, lq, d, kv_heads, lk)."""
    b, h, lq, d, g, ln = check_qkv(q, k_near, v_near)
    if w_uk.dim() != 3 or rows.dim() != 3:
        raise ValueError(f"w_uk must be [kv_heads, content dims, latent] and rows [b, kv_len, latent + kv_heads x "
                         f"rope dims]; got {list(w_uk.shape)} and {list(rows.shape)}")
    lk, (e_c, d_c) = rows.shape[1], w_uk.shape[1:]
    e_r = q_far.shape[-1] - e_c
    if not min(lk, lq + window - 1 if window > 0 else 0) <= ln <= lk:
        raise ValueError(f"k_near and v_near must cover the last {min(lk, lq + window - 1)} to {lk} positions (the "
                         f"window of every query; lk={lk} latents, q_len={lq}, window={window}); got {ln}")
    want = {"q_far": (q_far, (b, h, lq, e_r + e_c)), "rows": (rows, (b, lk, d_c + g * e_r)),
            "w_uk": (w_uk, (g, e_c, d_c)), "w_uv": (w_uv, (g, d, d_c))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or e_r < 0:
            raise ValueError(f"{name} must be {list(shape)} (b={b}, heads={h}, q_len={lq}, kv_heads={g}, kv_len={lk}, "
                             f"dim={d}, rope dims={e_r}, content dims={e_c}, latent={d_c}); got {list(t.shape)}")
    return b, h, lq, d, g, lk


def pack_rows(latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """latent [b, n, d_c], k_rope [b, kv_heads, n, e_r] -> the cache rows [b, n, d_c + kv_heads x e_r]."""
    b, g, n, e_r = k_rope.shape
    return torch.cat([latent, k_rope.transpose(1, 2).reshape(b, n, g * e_r).to(latent.dtype)], dim=-1)


def split_rows(rows: torch.Tensor, kv_heads: int, d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache rows [b, n, d_c + kv_heads x e_r] -> (latent [b, n, d_c], k_rope [b, kv_heads, n, e_r]), views."""
    latent, k_rope = rows.split([d_c, rows.shape[-1] - d_c], dim=-1)
    return latent, k_rope.unflatten(-1, (kv_heads, -1)).transpose(1, 2)


def query_rows(q_far: torch.Tensor, w_uk: torch.Tensor, e_r: int, dtype: torch.dtype) -> torch.Tensor:
    """The far queries q_far [..., kv_heads, m, e_r + e_c] (each KV head's m query rows) laid out as cache rows
    [..., kv_heads, m, d_c + kv_heads x e_r]: [q^C W_UK_g ; q^R in its KV head's slot g, zeros in the others], so
    one product with the rows scores every far key (absorbed). Computed in fp32, returned in ``dtype``."""
    g = w_uk.shape[0]
    q = q_far.float()
    latent = torch.einsum("...gme,gec->...gmc", q[..., e_r:], w_uk.float())
    slots = torch.einsum("...gme,gs->...gmse", q[..., :e_r], torch.eye(g, device=q.device)).flatten(-2)
    return torch.cat([latent, slots], dim=-1).to(dtype)
