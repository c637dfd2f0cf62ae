"""The rebuilt path of ``"dar_latent"`` (prefill and training): the far keys [k_rope ; c W_UK_g^T] and values
c W_UV_g^T are built once per call from the latent (2 x d_c x (e_c + d) multiply-adds per key and KV head),
then every query block reads them like host keys. Cheaper than the absorbed path when many queries share each
key."""

from __future__ import annotations

import torch

from ..common import default_scale
from .check import check_latent_call, split_rows
from .query_blocks import attend_in_blocks
from .reference import far_kv


def dar_latent_attention_rebuilt(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int,
                                 scale: float | None = None, mask: torch.Tensor | None = None,
                                 block: int = 256) -> torch.Tensor:
    """Same contract as ``dar_latent_attention_reference``; output in q's dtype; block: query rows per block."""
    b, h, lq, d, g, lk = check_latent_call(q, q_far, k_near, v_near, rows, w_uk, w_uv, window)
    far1_max = max(0, lk - window)  # no query reads a far key past this
    k_far, v_far = far_kv(*split_rows(rows[:, :far1_max], g, w_uk.shape[2]), w_uk, w_uv)
    k_far, v_far = k_far.to(q.dtype), v_far.to(v_near.dtype)  # [b, g, far, .]
    qf = q_far.view(b, g, h // g, lq, -1)

    def far_logits(s, e, far1):
        return qf[..., s:e, :].reshape(b, g, -1, qf.shape[-1]) @ k_far[:, :, :far1].transpose(-1, -2)

    def far_out(p, far1):
        return p @ v_far[:, :, :far1]

    return attend_in_blocks(q, k_near, v_near, lk, window, default_scale(d, scale), mask, far_logits, far_out, block)
