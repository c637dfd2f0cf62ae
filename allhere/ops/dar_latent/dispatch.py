"""``dar_latent_attention``: the entry of op family ``"dar_latent"``, routed by backend (``allhere.backend``):
"reference" builds the far keys densely in fp32 (``reference``); "torch" (every other backend) folds the
queries into the latent (``absorbed``) while a call has few queries -- decoding -- and rebuilds the far keys
once per call for longer ones: attending through torch's fused CPU kernel (``fused``) for an unmasked inference
prefill on the CPU, by query blocks (``rebuilt``) otherwise (training, masks, other devices). "triton" runs the
absorbed decode as one Triton kernel (``allhere.kernels.dar_latent_decode``) on the calls ``triton_refusal`` lets
through, and "auto" takes it on CUDA where it does (else the PyTorch path)."""

from __future__ import annotations

import torch

from ... import kernels
from ...backend import dispatch
from .absorbed import dar_latent_attention_absorbed
from .check import check_latent_call
from .fused import dar_latent_attention_fused, fused_applies
from .rebuilt import dar_latent_attention_rebuilt

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


def triton_refusal(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int, scale: float | None = None,
                   mask: torch.Tensor | None = None) -> str | None:
    """None where the decode kernel takes the call, else why not: triton installed; CUDA tensors (any device
    under Triton's interpreter); at most ``ABSORB_MAX_QUERIES`` queries; q, q_far, k_near, v_near and rows of
    one dtype, float16 or bfloat16 (float32 too under the interpreter, as the AHA kernels); no gradients."""
    refusal = kernels.device_refusal(q.device)
    if refusal:
        return refusal
    if q.shape[2] > ABSORB_MAX_QUERIES:
        return f"q_len={q.shape[2]}: the decode kernel takes at most {ABSORB_MAX_QUERIES} queries per call"
    others = (q_far, k_near, v_near, rows)
    if q.dtype not in kernels.kernel_dtypes(q.is_cuda) or any(t.dtype != q.dtype for t in others):
        return (f"dtype {q.dtype} (q_far {q_far.dtype}, k_near {k_near.dtype}, v_near {v_near.dtype}, rows "
                f"{rows.dtype}): the kernel takes float16 or bfloat16 (float32 would be rounded to tf32 by "
                f"Triton's dots on a GPU), one for all five")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, q_far, k_near, v_near, rows, w_uk, w_uv)):
        return "a call that needs gradients: the decode kernel has no backward"
    return None


def dar_latent_attention_triton(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int,
                                scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton decode kernel (imported on first use: triton may be missing), on arguments checked here."""
    from ...kernels.dar_latent_decode import dar_latent_decode_triton

    check_latent_call(q, q_far, k_near, v_near, rows, w_uk, w_uv, window)
    return dar_latent_decode_triton(q, q_far, k_near, v_near, rows, w_uk, w_uv, window, scale, mask)


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
