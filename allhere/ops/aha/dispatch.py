"""``aha_attention``: the one entry point of All-or-Here attention (op family ``"aha"``), routed by backend
(``allhere.backend``):

  - "reference": ``aha_attention_reference``, dense in fp32 (``row_start`` becomes a bool mask); the only
    path that takes a host's own softmax (``attend``);
  - "torch": the PyTorch path (``fast.aha_attention_torch``);
  - "triton": the Triton kernels (``triton_path``); a ValueError saying why where they cannot take the call
    (``triton_path.triton_refusal``);
  - "auto": the kernels on CUDA where they take the call, the PyTorch path everywhere else.
"""

from __future__ import annotations

import torch

from ...backend import dispatch, get_backend, select
from ..common import check_aha, default_scale
from .triton_path import triton_refusal


def _host_softmax(attend) -> str | None:
    return None if attend is None else ("the host's own softmax (attend: sink logits, soft-capped scores) runs on "
                                        "the reference path only")


def torch_takes(*args, attend=None, **kwargs) -> str | None:
    """None where the PyTorch path takes an ``aha_attention`` call, else why not."""
    return _host_softmax(attend)


def triton_takes(q, k, v, gate, *args, attend=None, sinks=0, **kwargs) -> str | None:
    """None where the Triton kernels take an ``aha_attention`` call, else why not."""
    return _host_softmax(attend) or triton_refusal(q, k, v, gate, sinks)


def aha_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                  scale: float | None = None, row_start: torch.Tensor | None = None,
                  backend: str | None = None, attend=None, kv_len: torch.Tensor | None = None,
                  sinks: int = 0) -> torch.Tensor:
    """All-or-Here attention (AHA paper Eq. 4): per (batch, head, query) full causal attention where the
    gate is 1, the ``window`` most recent keys (the query's own included) where it is 0, and with ``sinks``
    > 0 the first ``sinks`` keys of its segment too (attention sinks kept in the local branch,
    ``AHAConfig.sinks``).

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
    its gate; a local one also j < row_start + sinks, row_start 0 without segments).
    backend: "auto" | "torch" | "triton" | "reference"; None = ``allhere.backend.get_backend()`` (the
    innermost ``use_backend`` block, else "auto"). attend: the host's own attention under a bool mask
    (``AttentionCall.attend``), for a host whose softmax has terms of its own; only the reference takes it.
    kv_len: optional int [batch] on k's device, for one decode query per sequence (q_len 1) over a buffer of
    kv_len keys or more (a static cache): sequence i's keys are its first kv_len[i], its query the last of
    them. The Triton kernels read the lengths on the GPU (nothing goes back to the host: a CUDA graph can
    capture the call; a length past k's is k's, one under 1 gives zero); the other paths read them on the
    host, take each sequence's keys apart and refuse a length outside 1 to k's.
    Returns [batch, heads, q_len, dim] in q's dtype.
    """
    *_, d = check_aha(q, k, v, gate, window, row_start, gate_values=not gate.is_cuda, sinks=sinks)
    args = (q, k, v, gate, window, default_scale(d, scale))
    host = {} if attend is None else {"attend": attend}  # a path that takes no host softmax never sees it
    host["sinks"] = sinks
    if kv_len is not None:
        return _with_lengths(select("aha", *args, backend=backend, row_start=row_start, **host), args, row_start,
                             kv_len, host)
    return dispatch("aha", *args, backend=backend, row_start=row_start, **host)


def _with_lengths(path, args: tuple, row_start, kv_len: torch.Tensor, host: dict) -> torch.Tensor:
    """``path`` on a decode call whose sequences hold their first ``kv_len`` keys of k and v."""
    q, k, v, gate, *rest = args
    if q.shape[2] != 1 or tuple(kv_len.shape) != (q.shape[0],) or kv_len.is_floating_point():
        raise ValueError(f"kv_len takes one decode query per sequence and an int [batch] tensor, got q "
                         f"{tuple(q.shape)} and kv_len {tuple(kv_len.shape)} ({kv_len.dtype})")
    if path.backend == "triton":
        return path.fn(*args, row_start=row_start, kv_len=kv_len, **host)
    outs = []
    for i, n in enumerate(kv_len.tolist()):  # off the kernels: each sequence's own keys (reads the lengths)
        if not 1 <= n <= k.shape[2]:
            raise ValueError(f"kv_len[{i}] = {n}: a decode query needs 1 to {k.shape[2]} keys (k's length)")
        one = slice(i, i + 1)
        starts = None if row_start is None else row_start[one]
        outs.append(path.fn(q[one], k[one, :, :n], v[one, :, :n], gate[one], *rest, row_start=starts, **host))
    return torch.cat(outs)


def aha_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                       scale: float | None = None, chunk: int = 1024, dense_above: float = 0.5,
                       row_start: torch.Tensor | None = None, sinks: int = 0) -> torch.Tensor:
    """``aha_attention`` never on the reference: the backend of the enclosing ``use_backend`` block when it
    is "torch" or "triton", else "auto". chunk, dense_above: the PyTorch path's tuning
    (``fast.aha_attention_torch``)."""
    *_, d = check_aha(q, k, v, gate, window, row_start, gate_values=not gate.is_cuda, sinks=sinks)
    args = (q, k, v, gate, window, default_scale(d, scale))
    name = get_backend()
    path = select("aha", *args, backend=name if name in ("torch", "triton") else "auto", row_start=row_start,
                  sinks=sinks)
    if path.backend == "torch":
        return path.fn(*args, row_start=row_start, chunk=chunk, dense_above=dense_above, sinks=sinks)
    return path.fn(*args, row_start=row_start, sinks=sinks)
