"""The PyTorch path of All-or-Here attention (backend "torch"; CPU and GPU): skip the full attention of
local (token, head) pairs.

Inference (the gate needs no gradient):
  1. local attention for every query with the blocked sliding-window op (``block + w - 1`` keys each);
  2. the global queries are compacted per (batch, head) -- a different count for every head, never
     padded to the busiest head -- and only they run full causal attention, in chunks of ``chunk``
     queries that read the keys up to the chunk's last position (a head that is global for more
     than ``dense_above`` of its queries runs plain causal SDPA instead);
  3. their outputs are scattered over the local result.
The local result of a global query is computed and thrown away (a fraction mu_f of the local work).

Training (a straight-through gate, ``allhere.ops.ste``): the gate's gradient needs the value of both
outputs for every (token, head) -- dL/dgate = sum dL/da (a_full - a_local) -- but q, k and v get
gradients only through the output that was used. The backward is chosen here, not by the caller:
  - sparse (off CUDA): full attention runs for every query without autograd (a forward pass, only for
    that difference) and the differentiable part as in inference, so the backward is as sparse as
    inference (the Triton training kernels do the same on the GPU);
  - dense (on CUDA, where cuDNN's dense backward beats many small gathered calls): both outputs with
    autograd, combined.
Both give the same gradients (``tests/test_ops_aha.py``).

Segments (``row_start``): each run of queries of one segment runs alone over its segment's keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import hard_gate
from ..full import causal_attention
from ..sliding.blocked import sliding_window_attention
from ..ste import add_gate_gradient, trains_gate


def aha_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                        scale: float, row_start: torch.Tensor | None = None, chunk: int = 64,
                        dense_above: float = 0.5, sparse_backward: bool | None = None) -> torch.Tensor:
    """The "torch" backend of ``allhere.ops.aha.aha_attention`` (arguments checked there; ``scale`` given).
    Computes in q's dtype. chunk: global queries per full-attention call. dense_above: a (batch, head)
    whose share of global queries exceeds this runs plain causal SDPA over all its queries instead of
    gathering them. sparse_backward: None = the module docstring's choice (True off CUDA); tests set it."""
    if row_start is not None:
        if bool(row_start.any()):
            return _per_segment(q, k, v, gate, window, scale, row_start,
                                dict(chunk=chunk, dense_above=dense_above, sparse_backward=sparse_backward))
        # every query sees the whole prefix: plain causal
    hard = hard_gate(gate)
    training = trains_gate(gate)
    if sparse_backward is None:
        sparse_backward = not q.is_cuda
    a_local = sliding_window_attention(q, k, v, window, scale=scale)
    if training and not sparse_backward:
        a_full = causal_attention(q, k, v, scale=scale)
        return add_gate_gradient(torch.where(hard[..., None], a_full, a_local), gate, a_full, a_local)
    out = _scatter_global(q, k, v, hard, a_local, scale, chunk, dense_above)
    if not training:
        return out
    with torch.no_grad():  # the difference only: q, k, v get their gradients from the outputs used
        a_full = causal_attention(q, k, v, scale=scale)
    return add_gate_gradient(out, gate, a_full, a_local)


def _per_segment(q, k, v, gate, window, scale, row_start, options):
    """Every run of queries with the same segment start alone, over its segment's keys; queries that see
    no key (row_start -1) get zero."""
    b, h, lq, d = q.shape
    off = k.shape[2] - lq
    rows = []
    for i in range(b):
        starts, counts = torch.unique_consecutive(row_start[i], return_counts=True)
        pieces, r0 = [], 0
        for start, count in zip(starts.tolist(), counts.tolist()):
            r1 = r0 + count
            if start < 0:
                pieces.append(q.new_zeros(1, h, count, d))
            else:
                pieces.append(aha_attention_torch(q[i:i + 1, :, r0:r1], k[i:i + 1, :, start:off + r1],
                                                  v[i:i + 1, :, start:off + r1], gate[i:i + 1, :, r0:r1], window,
                                                  scale, **options))
            r0 = r1
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def _scatter_global(q, k, v, hard, out, scale, chunk, dense_above):
    b, h, lq, d = q.shape
    g = h // k.shape[1]
    off = k.shape[2] - lq
    idx = hard.nonzero()  # [P, 3] rows (batch, head, query), sorted
    if idx.numel() == 0:
        return out
    group = idx[:, 0] * h + idx[:, 1]
    groups, counts = torch.unique_consecutive(group, return_counts=True)
    # Per-(batch, head) views made once: with autograd, each piece's backward then touches its own head's
    # rows only, instead of allocating a gradient of the whole tensor per piece.
    qs = q.reshape(b * h, lq, d).unbind(0)
    ks, vs = (t.reshape(-1, t.shape[2], d).unbind(0) for t in (k, v))
    rows, pieces = [], []
    for bh, qi in zip(groups.tolist(), idx[:, 2].split(counts.tolist())):
        kv = (bh // h) * (h // g) + (bh % h) // g
        if qi.numel() > dense_above * lq:  # a busy head: dense causal is cheaper than gathering
            o = causal_attention(qs[bh][None, None], ks[kv][None, None], vs[kv][None, None], scale=scale)
            pieces.append(o[0, 0, qi])
            rows.append(bh * lq + qi)
            continue
        for qc in qi.split(chunk):
            n_keys = off + int(qc[-1]) + 1
            qpos = qc + off
            mask = torch.arange(n_keys, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qs[bh][qc][None], ks[kv][:n_keys][None], vs[kv][:n_keys][None],
                                               attn_mask=mask[None], scale=scale)
            pieces.append(o[0])
            rows.append(bh * lq + qc)
    flat = out.reshape(b * h * lq, d).index_put((torch.cat(rows),), torch.cat(pieces))
    return flat.view(b, h, lq, d)
