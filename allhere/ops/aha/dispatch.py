"""``aha_attention``: the one entry point of All-or-Here attention, routed by backend (``allhere.backend``).

  - "reference": ``aha_attention_naive``, dense in fp32 (``row_start`` becomes a bool mask);
  - "torch": the PyTorch path (``fast.aha_attention_torch``);
  - "triton": the Triton kernels (``triton_path``); a ValueError saying why where they cannot take the call;
  - "auto": the kernels on CUDA where they take the call, the PyTorch path everywhere else.
"""

from __future__ import annotations

import torch

from ...backend import get_backend
from ..common import check_aha, default_scale
from .fast import aha_attention_torch
from .naive import aha_attention_naive
from .triton_path import aha_attention_triton, triton_refusal


def aha_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                  scale: float | None = None, row_start: torch.Tensor | None = None,
                  backend: str | None = None) -> torch.Tensor:
    """All-or-Here attention (AHA paper Eq. 4): per (batch, head, query) full causal attention where the
    gate is 1, the ``window`` most recent keys (the query's own included) where it is 0.

    q: [batch, heads, q_len, dim]; k, v: [batch, kv_heads, kv_len, dim] (heads a multiple of kv_heads);
    the queries are the last q_len of the kv_len positions. scale: default 1 / sqrt(dim).
    gate: [batch, heads, q_len], bool, or a float holding only 0 and 1 -- the hard gate 1[s > tau] itself,
    e.g. ``allhere.ops.ste.straight_through(scores, tau)``, whose gradient then reaches the scores
    (straight-through, Eq. 3). The op never thresholds a gate: a float gate with other values raises
    ValueError, checked wherever that needs no GPU host sync -- always on the reference backend and for
    CPU tensors, not for a CUDA gate on the "torch", "triton" and "auto" backends.
    row_start: optional int [batch, q_len], per query the first key position of its segment (a sequence
    of a padded batch, a document of packed sequences; ``allhere.masks.segment_starts``), -1 = the query
    sees no key (zero output): a query at position p sees keys j with row_start <= j <= p (and the rule of
    its gate).
    backend: "auto" | "torch" | "triton" | "reference"; None = ``allhere.backend.get_backend()`` (the
    innermost ``use_backend`` block, else "auto"). Returns [batch, heads, q_len, dim] in q's dtype.
    """
    return _dispatch(q, k, v, gate, window, scale, row_start, get_backend(backend), {})


def aha_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                       scale: float | None = None, chunk: int = 1024, dense_above: float = 0.5,
                       row_start: torch.Tensor | None = None) -> torch.Tensor:
    """``aha_attention`` never on the reference: the backend of the enclosing ``use_backend`` block when it
    is "torch" or "triton", else "auto". chunk, dense_above: the PyTorch path's tuning
    (``fast.aha_attention_torch``)."""
    name = get_backend()
    return _dispatch(q, k, v, gate, window, scale, row_start, "auto" if name == "reference" else name,
                     dict(chunk=chunk, dense_above=dense_above))


def _dispatch(q, k, v, gate, window, scale, row_start, backend, torch_options):
    if backend == "reference":
        return aha_attention_naive(q, k, v, gate, window, scale, row_start=row_start)
    *_, d = check_aha(q, k, v, gate, window, row_start, gate_values=not gate.is_cuda)
    scale = default_scale(d, scale)
    if backend == "triton":
        why = triton_refusal(q, k, v, gate)
        if why is not None:
            raise ValueError(f"backend 'triton' cannot take this call: {why}")
        return aha_attention_triton(q, k, v, gate, window, scale, row_start)
    if backend == "auto" and q.is_cuda and triton_refusal(q, k, v, gate) is None:
        return aha_attention_triton(q, k, v, gate, window, scale, row_start)
    return aha_attention_torch(q, k, v, gate, window, scale, row_start, **torch_options)
