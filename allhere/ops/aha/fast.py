"""The PyTorch path of All-or-Here attention (backend "torch"; CPU and GPU): skip the full attention of
local (token, head) pairs.

Inference (the gate needs no gradient):
  1. local attention for every query with the blocked sliding-window op (``block + w - 1`` keys each, and the
     sinks where ``sinks`` > 0);
  2. only the global queries run full causal attention, in few large SDPA calls (a few hundred small
     calls cost more than the attention on the CPU): the sequence is cut into bands of ``chunk`` query
     positions and each band is one call over the keys up to the band's end, every (batch, head) with
     its own global queries of the band, padded to the busiest (batch, head) of that band (so a
     long-tailed head pays for itself, per band, not for the whole sequence); a head that is global
     for more than ``dense_above`` of its queries runs plain causal SDPA, all such heads in one call;
  3. their outputs are scattered over the local result.
The local result of a global query is computed and thrown away (a fraction mu_f of the local work).

Training (a straight-through gate, ``allhere.ops.ste``): the gate's gradient needs the value of both
outputs for every (token, head) -- dL/dgate = sum dL/da (a_full - a_local) -- but q, k and v get
gradients only through the output that was used. The backward is chosen here, not by the caller:
  - sparse (off CUDA, from ``SPARSE_BACKWARD_FROM`` queries on): full attention runs for every query
    without autograd (a forward pass, only for that difference) and the differentiable part as in
    inference, so the backward is as sparse as inference (the Triton training kernels do the same on the
    GPU);
  - dense (on CUDA, where cuDNN's dense backward beats many small gathered calls, and on short sequences,
    where the full attention is a small part of the step and one call beats gathering: a training step
    of the demo's shape, T = 256, is 1.29x the plain decoder's dense against 1.58x sparse, measured by
    ``benchmarks/train_step.py``): both outputs with autograd, combined.
Both give the same gradients (``tests/ops/test_ops_aha.py``).

Segments (``row_start``): each run of queries of one segment runs alone over its segment's keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import hard_gate
from ..full import causal_attention
from ..sliding.blocked import sliding_window_attention_torch
from ..ste import add_gate_gradient, trains_gate

SPARSE_BACKWARD_FROM = 1024  # queries: the sparse backward (off CUDA) from this length on, dense below
BUSY_FROM = 64  # queries: from this many on, a mostly-global (batch, head) runs dense causal attention
FEW_PAIRS = 16  # (batch, kv head) pairs with global queries in a band: up to this many, one call each


def aha_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                        scale: float, row_start: torch.Tensor | None = None, chunk: int = 1024,
                        dense_above: float = 0.5, sparse_backward: bool | None = None, sinks: int = 0) -> torch.Tensor:
    """The "torch" backend of ``allhere.ops.aha.aha_attention`` (arguments checked there; ``scale`` given).
    Computes in q's dtype. chunk: query positions per band of the global queries' calls (one SDPA call
    per band, over the keys up to its end). dense_above: a (batch, head) whose share of global queries
    exceeds this runs plain causal SDPA over all its queries instead of gathering them. sparse_backward:
    None = the module docstring's choice (True off CUDA from ``SPARSE_BACKWARD_FROM`` queries on); tests
    set it. sinks: a local query also reads the first ``sinks`` keys of its segment (in the local op)."""
    if row_start is not None:
        if bool(row_start.any()):
            return _per_segment(q, k, v, gate, window, scale, row_start,
                                dict(chunk=chunk, dense_above=dense_above, sparse_backward=sparse_backward,
                                     sinks=sinks))
        # every query sees the whole prefix: plain causal
    hard = hard_gate(gate)
    training = trains_gate(gate)
    lq = q.shape[2]
    if sparse_backward is None:
        sparse_backward = not q.is_cuda and lq >= SPARSE_BACKWARD_FROM
    a_local = sliding_window_attention_torch(q, k, v, window, scale=scale, sinks=sinks)
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


def _scatter_global(q, k, v, hard, out, scale, band, dense_above):
    """``out`` with the full causal attention of every global (batch, head, query) put in, in few large SDPA
    calls: the busy (batch, head) pairs (more than ``dense_above`` of their queries global) in one causal
    call; the others by bands of ``band`` query positions over the keys up to the band's end (``_band``:
    a call per bucket of (batch, kv head) pairs with similar counts)."""
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    off = k.shape[2] - lq
    counts = hard.sum(-1)  # [b, h]
    busy = (counts > dense_above * lq) & (lq >= BUSY_FROM)  # a decode step gathers nothing: no head is "busy"
    rows, pieces = [], []
    if bool(busy.any()):
        bi, hi = busy.nonzero(as_tuple=True)
        o = causal_attention(q[bi, hi][None], k[bi, hi // g][None], v[bi, hi // g][None], scale=scale)[0]
        used = hard[bi, hi]  # [busy pairs, lq]
        pieces.append(o[used])
        rows.append(((bi * h + hi)[:, None] * lq + torch.arange(lq, device=q.device))[used])
    sparse = hard & ~busy[..., None]
    for start in range(0, lq, band):
        end = min(lq, start + band)
        piece, row = _band(q, k, v, sparse[:, :, start:end], start, off + end, scale)
        if piece is not None:
            pieces.append(piece)
            rows.append(row)
    if not rows:
        return out
    flat = out.reshape(b * h * lq, d).index_put((torch.cat(rows),), torch.cat(pieces))
    return flat.view(b, h, lq, d)


def _band(q, k, v, sub, start, n_keys, scale):
    """Full causal attention of the global queries ``sub`` [b, h, L] (True = global) at positions start ..
    start + L - 1 over the first ``n_keys`` keys, in few SDPA calls. The work unit is a (batch, kv head)
    pair with the global queries of its query heads stacked as rows (their keys are read once); each pair
    has ``c`` rows per query head, c its busiest head's count in the band (shorter heads padded with copies
    of their first position: computed, never used). Pairs go into buckets of counts within a factor 2 of
    each other (a head global for 27% of the band is not padded onto one at 2%), one call per bucket over
    views of the keys when it holds every pair, over gathered keys otherwise; a decode-like band (at most
    ``FEW_PAIRS`` pairs with work, under half of them) runs one call per pair on views of its keys (no
    copy of a cache). Returns (outputs [P, d], their rows in the flat [b * h * lq] layout), or (None, None)
    when the band has no global query."""
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    per = sub.sum(-1)  # [b, h]
    m = int(per.max()) if per.numel() else 0
    if m == 0:
        return None, None
    bi, hi, ti = sub.nonzero(as_tuple=True)
    rank = sub.cumsum(-1)[bi, hi, ti] - 1
    pos = torch.full((b, h, m), start, dtype=torch.long, device=q.device)
    pos[bi, hi, rank] = ti + start
    qg = q.gather(2, pos[..., None].expand(b, h, m, d)).view(b * hkv, g, m, d)
    qpos = (pos + (k.shape[2] - lq)).view(b * hkv, g, m)
    ks, vs = (t[:, :, :n_keys].reshape(b * hkv, n_keys, d) for t in (k, v))  # a view when k, v are contiguous
    counts = per.view(b * hkv, g).amax(-1)  # rows per query head each pair needs
    order = counts.argsort(descending=True)
    order = order[: int((counts > 0).sum())].tolist()
    counts = counts.tolist()
    keys = torch.arange(n_keys, device=q.device)
    o = q.new_zeros(b * hkv, g, m, d)

    def attend(ids, c, keys_k, keys_v):
        rows = qg[ids, :, :c].reshape(len(ids), g * c, d)
        visible = keys <= qpos[ids, :, :c].reshape(len(ids), g * c)[..., None]
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        out = F.scaled_dot_product_attention(rows[:, None], keys_k[:, None], keys_v[:, None], attn_mask=bias[:, None],
                                             scale=scale)
        o[ids, :, :c] = out[:, 0].view(len(ids), g, c, d)

    if len(order) <= FEW_PAIRS and 2 * len(order) <= b * hkv:  # decode-like: each pair alone, on views
        for j in order:
            attend([j], counts[j], ks[j:j + 1], vs[j:j + 1])  # views
    else:
        while order:
            c = counts[order[0]]
            bucket = [j for j in order if 2 * counts[j] > c]
            order = order[len(bucket):]
            if len(bucket) == b * hkv:  # every pair: the keys as they are
                attend(list(range(b * hkv)), c, ks, vs)
            elif len(bucket) == 1:  # one pair: a view of its keys
                attend(bucket, c, ks[bucket[0]:bucket[0] + 1], vs[bucket[0]:bucket[0] + 1])
            else:
                attend(bucket, c, ks[bucket], vs[bucket])
    o = o.view(b, h, m, d)
    return o[bi, hi, rank], (bi * h + hi) * lq + ti + start
