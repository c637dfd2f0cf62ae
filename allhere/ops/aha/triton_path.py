"""The "triton" backend of All-or-Here attention: which calls the Triton kernels (``allhere.kernels``)
take, and the glue that runs them.

They take: triton installed; CUDA tensors (or any device under Triton's interpreter); float16 / bfloat16
(fp32 stays on the PyTorch path on a GPU: Triton's dots would round it to tf32; the interpreter computes
it exactly); a head dim that is a power of two from 16 to 128 (at 256 the default tiles need more shared
memory than an H100 gives a block: ``benchmarks/kernel_compile.py --head-dim 256``); a whole sequence
(q_len == kv_len) or a one-token decode step without gradients.

  - a one-token decode step: the split-KV decode kernels;
  - a whole sequence without gradients: the prefill kernels (packed global queries);
  - a whole sequence with gradients: the training kernels (the same forward, a backward through the used
    paths only); for a straight-through gate, a_full comes from a forward pass only (dense SDPA, or the
    packed global kernel within segments).
Segments (``row_start``) run in the same launch in all three, and so do the sinks of the local branch
(``sinks``: the first keys of each segment, a compile-time constant of the kernels).
"""

from __future__ import annotations

import torch

from ... import kernels
from ..common import hard_gate
from ..full import causal_attention
from ..ste import add_gate_gradient, trains_gate


def needs_grad(q, k, v, gate) -> bool:
    return trains_gate(gate) or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))


def triton_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, sinks: int = 0) -> str | None:
    """None where the kernels take this call (see the module docstring), else why not. Any ``sinks`` is taken."""
    refusal = kernels.device_refusal(q.device)
    if refusal:
        return refusal
    if q.dtype not in kernels.kernel_dtypes(q.is_cuda) or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"dtype {q.dtype} (k {k.dtype}, v {v.dtype}): the kernels take float16 or bfloat16 (float32 "
                f"would be rounded to tf32 by Triton's dots on a GPU), the same for q, k and v")
    d, lq, lk = q.shape[-1], q.shape[2], k.shape[2]
    if not 16 <= d <= 128 or d & (d - 1):
        return f"head dim {d}: the kernels take a power of two from 16 to 128"
    if lq != lk and lq != 1:
        return (f"q_len={lq} with kv_len={lk}: the kernels take a whole sequence (q_len == kv_len) or one "
                f"decode step (q_len == 1)")
    if lq != lk and needs_grad(q, k, v, gate):
        return "a decode step (q_len=1 < kv_len) that needs gradients: the training kernels take whole sequences"
    return None


def aha_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                         scale: float, row_start: torch.Tensor | None = None,
                         kv_len: torch.Tensor | None = None, sinks: int = 0) -> torch.Tensor:
    """The kernels on a call they take (``triton_refusal`` is None; arguments checked by the caller); kv_len
    (decode only): each sequence's length in k and v, read by the decode kernel on the device."""
    hard = hard_gate(gate)
    lq, lk = q.shape[2], k.shape[2]
    if needs_grad(q, k, v, gate):
        from ...kernels.aha_train import aha_train_triton

        out, a_local = aha_train_triton(q, k, v, hard, window, scale, row_start=row_start, sinks=sinks)
        if not trains_gate(gate):
            return out
        with torch.no_grad():
            if row_start is None:
                a_full = causal_attention(q, k, v, scale=scale)
            else:  # full attention within the segments (dense SDPA has no such mask without materialising it)
                from ...kernels.aha_prefill import causal_triton

                a_full = causal_triton(q, k, v, scale, row_start)
        return add_gate_gradient(out, gate, a_full, a_local)
    if lq == 1:
        from ...kernels.aha_decode import aha_decode_triton

        kv_start = None if row_start is None else torch.where(row_start[:, 0] < 0, lk, row_start[:, 0])
        return aha_decode_triton(q, k, v, hard[..., 0], window, scale, kv_start=kv_start, kv_len=kv_len, sinks=sinks)
    from ...kernels.aha_prefill import aha_prefill_triton

    return aha_prefill_triton(q, k, v, hard, window, scale, row_start=row_start, sinks=sinks)
