"""Fast All-or-Here attention (CPU and GPU): skip the full attention of local (token, head) pairs.

On CUDA with triton installed and fp16 / bf16 inputs, ``allhere.kernels`` takes over: a one-token decode
step and a whole-sequence prefill without gradients run the inference kernels (split-KV decode; packed
global queries), a whole-sequence call that needs gradients runs the training kernels (the same forward,
a backward through the used paths only). Everything else runs the PyTorch path below.

Inference (the gate needs no gradient):
  1. local attention for every query with the blocked sliding-window op (``block + w - 1`` keys each);
  2. the global queries are compacted per (batch, head) -- a different count for every head, never
     padded to the busiest head -- and only they run full causal attention, in chunks of ``chunk``
     queries that read the keys up to the chunk's last position (a head that is global for more
     than ``dense_above`` of its queries runs plain causal SDPA instead);
  3. their outputs are scattered over the local result.
The local result of a global query is computed and thrown away (a fraction mu_f of the local work).

Training (a float gate that requires grad): the straight-through estimator needs the value of both
outputs for every (token, head) -- dL/dgate = sum dL/da (a_full - a_local) -- but gradients flow only
into the output that was used: the full path of global pairs and the local path of local pairs. So
full attention runs for every query without autograd (a forward pass, only for that difference) and the
differentiable part as in inference: the backward is as sparse as inference. That is what the Triton
training kernels do and, on the PyTorch path, ``sparse_backward`` (the default off CUDA). With
``sparse_backward=False`` (the PyTorch path's default on CUDA, where cuDNN's dense backward beats many
small gathered calls) both outputs are computed densely with autograd and combined. All give the same
gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import check_gate, check_qkv, check_window, combine_gated, default_scale, hard_gate
from ..full import causal_attention
from ..sliding.blocked import sliding_window_attention


def aha_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                       scale: float | None = None, chunk: int = 64, dense_above: float = 0.5,
                       sparse_backward: bool | None = None, row_start: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``aha_attention_naive``, without a general mask; computes in q's dtype.

    chunk: global queries per full-attention call. dense_above: a (batch, head) whose share of global
    queries exceeds this runs plain causal SDPA over all its queries instead of gathering them.
    sparse_backward: training only; None = True off CUDA, False on CUDA (see the module docstring).
    row_start: optional int [batch, q_len] from ``allhere.masks.segment_starts``: each query sees only the
    keys from ``row_start`` on (its segment: a sequence of a padded batch, a document of packed
    sequences), -1 = no key at all (zero output). The Triton kernels take the segments in the same launch
    (prefill, training, decode steps); on the PyTorch path each run of queries of one segment runs alone
    over its segment's keys.
    """
    _, _, lq, d, _, lk = check_qkv(q, k, v)
    check_gate(gate, q)
    check_window(window)
    scale = default_scale(d, scale)
    hard = hard_gate(gate)
    training = gate.dtype != torch.bool and gate.requires_grad
    needs_grad = training or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    kernels = _triton_shape(q, k)
    # The kernels take segments themselves, all in one launch: prefill, training, and decode steps.
    native = kernels and (lq == lk or not needs_grad)
    if row_start is not None and not native:
        if bool(row_start.any()):
            return _per_segment(q, k, v, gate, window, scale, row_start,
                                dict(chunk=chunk, dense_above=dense_above, sparse_backward=sparse_backward))
        row_start = None  # every query sees the whole prefix: plain causal
    if native:
        if needs_grad:
            from ...kernels.aha_train import aha_train_triton

            out, a_local = aha_train_triton(q, k, v, hard, window, scale, row_start=row_start)
            if not training:
                return out
            if row_start is None:
                return _straight_through(out, gate, a_local, lambda: causal_attention(q, k, v, scale=scale))
            from ...kernels.aha_prefill import causal_triton

            # Full attention within the segments (dense SDPA has no such mask without materialising it).
            return _straight_through(out, gate, a_local, lambda: causal_triton(q, k, v, scale, row_start))
        if lq == 1:
            from ...kernels.aha_decode import aha_decode_triton

            kv_start = None if row_start is None else torch.where(row_start[:, 0] < 0, lk, row_start[:, 0])
            return aha_decode_triton(q, k, v, hard[..., 0], window, scale, kv_start=kv_start)
        from ...kernels.aha_prefill import aha_prefill_triton

        return aha_prefill_triton(q, k, v, hard, window, scale, row_start=row_start)
    if sparse_backward is None:
        sparse_backward = not q.is_cuda
    a_local = sliding_window_attention(q, k, v, window, scale=scale)
    if training and not sparse_backward:
        return combine_gated(hard, gate, causal_attention(q, k, v, scale=scale), a_local)
    out = _scatter_global(q, k, v, hard, a_local, scale, chunk, dense_above)
    if not training:
        return out
    return _straight_through(out, gate, a_local, lambda: causal_attention(q, k, v, scale=scale))


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
                pieces.append(aha_attention_fast(q[i:i + 1, :, r0:r1], k[i:i + 1, :, start:off + r1],
                                                 v[i:i + 1, :, start:off + r1], gate[i:i + 1, :, r0:r1], window,
                                                 scale, **options))
            r0 = r1
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def _straight_through(out, gate, a_local, full):
    """Adds the straight-through term: zero in value, dL/dgate = sum dL/da (a_full - a_local). a_full =
    full() is a forward pass only (no autograd): the gradient of q, k, v came from the used outputs."""
    with torch.no_grad():
        diff = full() - a_local
    return out + (gate - gate.detach()).to(out.dtype)[..., None] * diff


def _triton_shape(q, k) -> bool:
    """The Triton kernels (``allhere.kernels``) take this call: CUDA, triton installed, fp16 / bf16 (fp32
    stays on the PyTorch path: Triton's dots would round it to tf32), head dim a power of two from 16 to
    128 (at 256 the default tiles need more shared memory than an H100 gives a block:
    ``benchmarks/kernel_compile.py --head-dim 256``), and a prefill over the whole sequence or a one-token
    decode step."""
    from ... import kernels

    d, lq, lk = q.shape[-1], q.shape[2], k.shape[2]
    return (kernels.use_triton(q) and q.dtype in (torch.float16, torch.bfloat16) and 16 <= d <= 128
            and d & (d - 1) == 0 and (lq == lk or lq == 1))


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
