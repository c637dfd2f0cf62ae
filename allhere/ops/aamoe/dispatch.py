"""``aamoe_attention``: the entry of op family ``"aamoe"``, routed by backend (``allhere.backend``):
"reference" scores every key densely in fp32 (``reference``), every other backend reads only the chosen
resources (``gathered``)."""

from __future__ import annotations

import torch

from ...backend import dispatch


def aamoe_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor,
                    choice: torch.Tensor, logp: torch.Tensor, chunk: int, own_chunk: bool,
                    scale: float | None = None, q_mem: torch.Tensor | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """AA-MoE attention: each query reads the keys of the resources it chose (``choice``, biased by
    ``logp``) and, with ``own_chunk``, its own chunk up to itself. q [b, h, lq, d]; k, v [b, kv_heads, lk, d]
    (queries = the last lq positions); mem_k, mem_v [h, E, chunk, d]; choice, logp [b, lq, K]
    (``allhere.ops.aamoe.common``); q_mem: the queries that read the expert slots (default q). A query with
    no key at all returns 0. backend: as ``allhere.backend``; None = the innermost ``use_backend`` block.
    Returns [b, h, lq, d] in q's dtype."""
    return dispatch("aamoe", q, k, v, mem_k, mem_v, choice, logp, chunk, own_chunk, scale, q_mem, backend=backend)
