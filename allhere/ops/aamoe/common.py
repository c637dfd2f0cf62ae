"""The argument contract shared by the AA-MoE ops.

Resources are indexed as rows of the document's representation tensor X (Eq. 6): context chunks first,
0 .. n_chunks - 1 with n_chunks = ceil(kv_len / m) (chunk j = key positions j m .. j m + m - 1), then the
experts n_chunks .. n_chunks + E - 1. ``choice`` [b, q_len, K] holds the chosen resource of each rank
(-1 = rank unused); ``logp`` [b, q_len, K] the bias log P(i, j_k) of each rank (read where choice >= 0).
A chosen chunk must lie wholly before the query's own chunk (the router's contract; the ops also mask
any key after the query). ``own_chunk``: every query also reads the keys of its own chunk up to itself,
with bias 0 (outside the budget).
"""

from __future__ import annotations

import torch

from ..common import check_qkv


def check_aamoe(q, k, v, mem_k, mem_v, choice, logp, chunk) -> tuple[int, int, int, int, int]:
    """Validate; return (q_len, kv_len, dim, experts, n_chunks)."""
    b, h, lq, d, _, lk = check_qkv(q, k, v)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if mem_k.shape != mem_v.shape or mem_k.dim() != 4 or mem_k.shape[0] != h or mem_k.shape[2:] != (chunk, d):
        raise ValueError(f"mem_k and mem_v must be [heads={h}, experts, chunk={chunk}, dim={d}], got "
                         f"{tuple(mem_k.shape)}, {tuple(mem_v.shape)}")
    if choice.dim() != 3 or tuple(choice.shape[:2]) != (b, lq) or choice.dtype != torch.long:
        raise ValueError(f"choice must be int64 [batch={b}, q_len={lq}, ranks], "
                         f"got {choice.dtype} {tuple(choice.shape)}")
    if logp.shape != choice.shape:
        raise ValueError(f"logp must have choice's shape {tuple(choice.shape)}, got {tuple(logp.shape)}")
    experts, n_chunks = mem_k.shape[1], -(-lk // chunk)
    if choice.numel() and int(choice.max()) >= n_chunks + experts:
        raise ValueError(f"choice holds resource {int(choice.max())} "
                         f"but there are {n_chunks} chunks + {experts} experts")
    return lq, lk, d, experts, n_chunks
