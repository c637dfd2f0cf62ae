"""``dar_latent_attention``: the entry of op family ``"dar_latent"``, routed by backend (``allhere.backend``):
"reference" builds the far keys densely in fp32 (``reference``); "torch" (every other backend) folds the
queries into the latent (``absorbed``) while a call has few queries -- decoding -- and rebuilds the far keys
once per call for longer ones: attending through torch's fused CPU kernel (``fused``) for an unmasked inference
prefill on the CPU, by query blocks (``rebuilt``) otherwise (training, masks, other devices)."""

from __future__ import annotations

import torch

from ...backend import dispatch, register_path
from .absorbed import dar_latent_attention_absorbed
from .fused import dar_latent_attention_fused, fused_applies
from .rebuilt import dar_latent_attention_rebuilt
from .reference import dar_latent_attention_reference

# queries per call up to which "torch" absorbs: absorbing costs ~2 d_c (e_c + d) per (query head, far key) where
# rebuilding costs that once per (KV head, far key), so it pays while the queries sharing a key stay few
ABSORB_MAX_QUERIES = 16


def dar_latent_attention_torch(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int,
                               scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch path: absorbed for calls of at most ``ABSORB_MAX_QUERIES`` queries; else fused where
    ``fused_applies``, rebuilt otherwise."""
    if q.shape[2] <= ABSORB_MAX_QUERIES:
        path = dar_latent_attention_absorbed
    elif fused_applies(q, mask, q_far, k_near, v_near, rows, w_uk, w_uv):
        path = dar_latent_attention_fused
    else:
        path = dar_latent_attention_rebuilt
    return path(q, q_far, k_near, v_near, rows, w_uk, w_uv, window, scale, mask)


register_path("dar_latent", "reference", dar_latent_attention_reference)
register_path("dar_latent", "torch", dar_latent_attention_torch)


def dar_latent_attention(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int,
                         scale: float | None = None, mask: torch.Tensor | None = None,
                         backend: str | None = None) -> torch.Tensor:
    """DAR with distant keys scored in the latent (decoupled RoPE): query i reads key j from (k_near, v_near) when
    i - j < window, else as the latent form [k_rope_j ; c_j W_UK_g^T] / c_j W_UV_g^T of its cache row
    rows_j = [c_j ; k_rope_j of every KV head], with its far query q_far,
    one softmax over both. Shapes as ``dar_latent_attention_reference``. backend: as ``allhere.backend``; None =
    the innermost ``use_backend`` block. Returns q's dtype."""
    return dispatch("dar_latent", q, q_far, k_near, v_near, rows, w_uk, w_uv, window, scale, mask,
                    backend=backend)
