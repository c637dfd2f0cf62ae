"""The absorbed path of ``"dar_latent"`` (decode): each query's content part folded into the latent space
once (q~ = q_c W_UK_g, d_c numbers per head), so a far key costs a dot product with its cached row
[c_j ; k^R_j] -- multi-query attention over the rows as the cache holds them -- and the far values are summed in
the latent and up-projected once per head and query (o = (sum_j p_ij c_j) W_UV_g^T), as in DeepSeek-V2's
multi-head latent attention ("DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
Model", arXiv:2405.04434). No far key or value is ever rebuilt, and the rows are read in place: a head's query
is laid out as a row, [q~ ; its rotated part in its KV head's slot, zeros in the others]."""

from __future__ import annotations

import torch

from ..common import default_scale
from .check import check_latent_call, query_rows
from .query_blocks import attend_in_blocks


def dar_latent_attention_absorbed(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int,
                                  scale: float | None = None, mask: torch.Tensor | None = None,
                                  block: int = 256) -> torch.Tensor:
    """Same contract as ``dar_latent_attention_reference``; output in q's dtype; block: query rows per block."""
    b, h, lq, d, g, lk = check_latent_call(q, q_far, k_near, v_near, rows, w_uk, w_uv, window)
    n, (e_c, d_c) = h // g, w_uk.shape[1:]
    e_r = q_far.shape[-1] - e_c
    q_row = query_rows(q_far.view(b, g, n * lq, -1), w_uk, e_r, rows.dtype).view(b, g, n, lq, -1)

    def far_logits(s, e, far1):
        m = n * (e - s)
        # rows @ q^T, not q @ rows^T: torch's CPU batched matmul copies a transposed view of the rows in bf16
        return (rows[:, :far1] @ q_row[..., s:e, :].reshape(b, g * m, -1).transpose(-1, -2)).mT.view(b, g, m, far1)

    def far_out(p, far1):
        m = p.shape[2]
        summed = (p.to(rows.dtype).reshape(b, g * m, far1) @ rows[:, :far1]).view(b, g, m, -1)[..., :d_c]
        return torch.einsum("bgmc,gdc->bgmd", summed, w_uv.to(summed.dtype)).to(v_near.dtype)

    return attend_in_blocks(q, k_near, v_near, lk, window, default_scale(d, scale), mask, far_logits, far_out, block)
