"""Dense reference of All-or-Here attention (AHA paper Eq. 4), in fp32: the ground truth of every other path."""

from __future__ import annotations

import torch

from ...masks.predicates import causal, dense_mask
from ..common import check_aha, default_scale, hard_gate, masked_attention_reference, segment_mask
from ..sliding.reference import local_pattern
from ..ste import add_gate_gradient, trains_gate


def aha_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, window: int,
                            scale: float | None = None, mask: torch.Tensor | None = None,
                            row_start: torch.Tensor | None = None, attend=None, sinks: int = 0) -> torch.Tensor:
    """All-or-Here attention, computed densely in fp32 (``aha_attention(..., backend="reference")``).

    q: [batch, heads, q_len, dim]; k, v: [batch, kv_heads, kv_len, dim] (heads % kv_heads == 0);
    queries are the last q_len positions. gate: [batch, heads, q_len], bool, or a float holding only 0 and
    1 (checked: anything else raises ValueError); 1 = full causal attention over the whole prefix, 0 = the
    ``window`` most recent keys, the current one included, and the first ``sinks`` keys of the query's
    segment (of the sequence without ``row_start``). A float gate that requires grad is a
    straight-through gate (``allhere.ops.ste``): it gets dL/dgate = sum dL/da (a_full - a_local).
    row_start: optional int [batch, q_len], per query the first key of its segment, -1 = no key
    (``allhere.ops.common.segment_mask``). mask: optional bool, broadcastable to [batch, heads, q_len,
    kv_len]. Both are ANDed with both patterns; a query that may see no key gets a zero output.
    attend: optional ``attend(q, k, v, allowed bool [batch, heads or 1, q_len, kv_len]) -> [batch, heads,
    q_len, dim]`` computing both attentions instead of the fp32 softmax (a host whose softmax has sink logits
    or soft-capped scores; ``AttentionCall.attend``). Returns [batch, heads, q_len, dim] in q's dtype.
    """
    lq, lk, d = check_aha(q, k, v, gate, window, row_start, sinks=sinks)
    scale = default_scale(d, scale)
    full = dense_mask(causal, lq, lk, q.device)
    local = dense_mask(local_pattern(window, sinks, row_start, lk - lq), lq, lk, q.device, batch=q.shape[0])
    for m in (mask, None if row_start is None else segment_mask(row_start, lq, lk)):
        if m is not None:
            full, local = full & m, local & m
    if attend is None:
        a_full = masked_attention_reference(q, k, v, full, scale)
        a_local = masked_attention_reference(q, k, v, local, scale)
    else:
        a_full, a_local = attend(q, k, v, full), attend(q, k, v, local)
    out = torch.where(hard_gate(gate)[..., None], a_full, a_local)
    if trains_gate(gate):
        out = add_gate_gradient(out, gate, a_full, a_local)
    return out.to(q.dtype)
