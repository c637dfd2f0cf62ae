"""The absorbed path of ``"dar_latent"`` (decode): each query's content part folded into the latent space
once (q~ = q_c W_UK_g, d_c numbers per head), so a far key costs a dot product with its cached latent and
rotated key -- multi-query attention over [c_j ; k_rope_j] -- and the far values are summed in the latent and
up-projected once per head and query (o = (sum_j p_ij c_j) W_UV_g^T), as in DeepSeek-V2's multi-head latent
attention ("DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model",
arXiv:2405.04434). No far key or value is ever rebuilt."""

from __future__ import annotations

import torch

from ..common import default_scale
from .blocks import attend_in_blocks
from .check import check_latent_call


def dar_latent_attention_absorbed(q, q_far, k_near, v_near, latent, k_rope, w_uk, w_uv, window: int,
                                  scale: float | None = None, mask: torch.Tensor | None = None,
                                  block: int = 256) -> torch.Tensor:
    """Same contract as ``dar_latent_attention_reference``; output in q's dtype; block: query rows per block."""
    b, h, lq, d, g, lk = check_latent_call(q, q_far, k_near, v_near, latent, k_rope, w_uk, w_uv)
    e_r = k_rope.shape[-1]
    qf = q_far.view(b, g, h // g, lq, -1)
    q_rope = qf[..., :e_r]
    q_lat = torch.einsum("bgnqe,gec->bgnqc", qf[..., e_r:], w_uk.to(q.dtype))  # [b, g, group, lq, d_c]
    c = latent[:, None, None]  # [b, 1, 1, lk, d_c]: one latent for every head

    def far_logits(s, e, far1):
        return (q_rope[..., s:e, :] @ k_rope[:, :, None, :far1].transpose(-1, -2)
                + q_lat[..., s:e, :] @ c[..., :far1, :].transpose(-1, -2))

    def far_out(p, s, e, far1):
        summed = p.to(latent.dtype) @ c[..., :far1, :]  # [b, g, group, rows, d_c]
        return torch.einsum("bgnqc,gdc->bgnqd", summed, w_uv.to(summed.dtype)).to(v_near.dtype)

    return attend_in_blocks(q, k_near, v_near, lk, window, default_scale(d, scale), mask, far_logits, far_out, block)
