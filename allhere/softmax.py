"""The softmax arithmetic every layer shares, written once: the default scale of the scores, the guard of a row
that reads no key, a softmax that also gives its log-sum-exp, and the merges of partial softmax results by their
log-sum-exps -- how a softmax over many keys is computed in parts (a ring's blocks, a paged cache's pieces, DAR's
near and far keys, a decode kernel's splits) and stays exact. Plain torch: the kernels, the ops, the mechanisms,
the ring and the serving code all import it, and it imports nothing of allhere.

A partial result over a set of keys is a pair (out, lse): out = sum_j p_j v_j with p the softmax over those keys
alone, lse = log sum_j exp(s_j) of their scores s (natural log, unless a function says base 2). A row that reads no
key of a part has lse = -inf (``NEG_INF``) and any out: a merge gives it weight 0, and a row that reads no key of
any part gets out 0 (never NaN).
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")  # the score of a key a row may not read; the log-sum-exp of a row that reads no key
LSE_FLOOR = torch.finfo(torch.float32).min  # what ``clamp_empty`` raises -inf to


def default_scale(d: int, scale: float | None) -> float:
    """The factor of the scores q . k: ``scale``, or 1 / sqrt(d) for heads of size d where it is None."""
    return 1.0 / math.sqrt(d) if scale is None else scale


def clamp_empty(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp (or a row maximum) made safe to subtract from its row's scores: -inf -- a row that read no
    key -- raised to the lowest float32, so exp(-inf - it) is 0, not NaN. Finite values pass unchanged."""
    return lse.clamp_min(LSE_FLOOR)


def softmax_lse(s: torch.Tensor, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores s [..., keys] (float32; -inf where a key is not read) -> (softmax p [..., keys], log-sum-exp
    [...]); a row that reads no key: p 0, lse -inf. ``inplace``: p is written over s."""
    lse = torch.logsumexp(s, -1)
    top = clamp_empty(lse)[..., None]
    return (s.sub_(top).exp_() if inplace else torch.exp(s - top)), lse


def merge_lse(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp over two disjoint sets from theirs, log(exp(a) + exp(b)); ``a`` None (nothing yet): b."""
    return b if a is None else torch.logaddexp(a, b)


def merge_pair(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor,
               fma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys, (o1 [..., d], l1 [...]) and (o2, l2), -> the result over both:
    (out [..., d], in the wider of the outputs' dtypes and the log-sum-exps', lse [...]). ``fma``: the second part
    is added into the first's weighted output in place with one multiply-add (``addcmul_``: one temporary less,
    and one rounding less where the device fuses it, so the last bit may differ from the default's)."""
    lse = merge_lse(l1, l2)
    top = clamp_empty(lse)
    w1, w2 = torch.exp(l1 - top)[..., None], torch.exp(l2 - top)[..., None]
    return ((o1 * w1).addcmul_(o2, w2) if fma else o1 * w1 + o2 * w2), lse


def merge_pieces(found, n_rows: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over every piece a row read, the rows scattered: ``found`` holds (row ids [n, size] (-1:
    padding), output [n, size, d], log-sum-exp [n, size]), any number of pieces per row; returns (output [n_rows,
    d] float32, 0 for a row that read nothing; its log-sum-exp [n_rows], -inf there)."""
    m = torch.full((n_rows + 1,), NEG_INF, device=device)  # the last entry takes the padding
    rows = [r.flatten().where(r.flatten() >= 0, n_rows) for r, _, _ in found]
    for r, (_, _, lse) in zip(rows, found):
        m.scatter_reduce_(0, r, lse.flatten(), "amax")
    m = clamp_empty(m)  # rows that read nothing: weights exp(-inf) = 0, not NaN
    acc = torch.zeros(n_rows + 1, d, device=device)
    den = torch.zeros(n_rows + 1, device=device)
    for r, (_, o, lse) in zip(rows, found):
        w = torch.exp(lse.flatten() - m[r])
        acc.index_add_(0, r, o.reshape(-1, d).float() * w[:, None])
        den.index_add_(0, r, w)
    out = (acc / torch.where(den > 0, den, 1.0)[:, None])[:n_rows]
    return out, (m + torch.log(den))[:n_rows].masked_fill(den[:n_rows] == 0, NEG_INF)


def merge_splits(lse: torch.Tensor, *outs: torch.Tensor, dim: int, base2: bool = False) -> tuple[torch.Tensor, ...]:
    """Partial results side by side along dimension ``dim`` (a kernel's splits of the keys): log-sum-exps ``lse``
    [..., splits, ...] (base 2 with ``base2``) and any number of outputs [..., splits, ..., width] weighted alike
    (one per accumulator) -> the merged outputs, ``dim`` summed away; a row no split read gives 0."""
    top = clamp_empty(lse.amax(dim, keepdim=True))
    w = (torch.exp2 if base2 else torch.exp)(lse - top).unsqueeze(-1)
    total = w.sum(dim).clamp_min(1e-30)
    return tuple((w * o).sum(dim) / total for o in outs)
