"""Shared helpers of the attention ops: argument checks, the gate contract, segment masks, dense masked
attention in fp32."""

from __future__ import annotations

import torch

from .._deprecated import moved_names
from ..masks.mask import MaskFn
from ..masks.predicates import and_masks, causal, dense_mask
from ..masks.segments import within_segments
from ..softmax import NEG_INF, default_scale  # noqa: F401  (default_scale: the ops' name for it too)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate the op layout; return (batch, heads, q_len, dim, kv_heads, kv_len)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [batch, heads, seq, dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, lq, d = q.shape
    bk, hkv, lk, dk = k.shape
    if k.shape != v.shape or bk != b or dk != d:
        raise ValueError(f"k and v must be [batch={b}, kv_heads, kv_len, dim={d}] and equal; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if h % hkv != 0:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={hkv}")
    if lq > lk:
        raise ValueError(f"q_len={lq} must be <= kv_len={lk} (queries are the last q_len positions)")
    return b, h, lq, d, hkv, lk


def check_gate(gate: torch.Tensor, q: torch.Tensor, values: bool = True) -> None:
    """The gate contract of the AHA ops: shape [batch, heads, q_len]; bool, or a float holding only 0 and
    1 (``allhere.ops.ste.straight_through(scores, tau)``; the ops never re-threshold, so a gate of raw
    scores is refused rather than cut at 0.5). ``values=False`` skips the value check (it reads the gate
    back: a host sync on a GPU)."""
    if tuple(gate.shape) != tuple(q.shape[:3]):
        raise ValueError(f"gate must be [batch, heads, q_len] = {tuple(q.shape[:3])}, got {tuple(gate.shape)}")
    if gate.dtype == torch.bool:
        return
    if not gate.is_floating_point():
        raise ValueError(f"gate must be bool or a 0/1-valued float tensor, got dtype {gate.dtype}")
    if values:
        g = gate.detach()
        other = g[(g != 0) & (g != 1)]
        if other.numel():
            raise ValueError(f"a float gate must hold only 0 and 1 (the hard gate 1[s > tau], e.g. from "
                             f"allhere.ops.ste.straight_through(scores, tau)); got {other.numel()} other value(s), "
                             f"e.g. {other[0].item()!r}: the ops do not threshold scores themselves")


def hard_gate(gate: torch.Tensor) -> torch.Tensor:
    """The bool gate of a gate that meets ``check_gate``'s contract (True = full attention)."""
    return gate if gate.dtype == torch.bool else gate.detach() != 0


def check_row_start(row_start: torch.Tensor | None, q: torch.Tensor) -> None:
    if row_start is None:
        return
    if (tuple(row_start.shape) != (q.shape[0], q.shape[2]) or row_start.is_floating_point()
            or row_start.dtype == torch.bool):
        raise ValueError(f"row_start must be an integer tensor [batch, q_len] = {(q.shape[0], q.shape[2])}, got "
                         f"{row_start.dtype} {tuple(row_start.shape)}")


def segment_mask(row_start: torch.Tensor, q_len: int, kv_len: int, pattern: MaskFn = causal,
                 key_offset: int = 0) -> torch.Tensor:
    """bool [batch, 1, q_len, kv_len]: ``pattern`` (a predicate on absolute positions, causal by default)
    within segments. ``row_start`` [batch, q_len]: per query the absolute position of the first key of
    its segment (a sequence of a padded batch, a document of packed sequences; ``allhere.masks``), -1 =
    no key at all. Queries are the last q_len of the kv_len keys; ``key_offset``: the absolute position
    of the first key (a rolling cache that dropped older keys). With the causal pattern the query at
    position p sees keys j with row_start <= j <= p."""
    q_first = key_offset + kv_len - q_len
    pred = and_masks(pattern, within_segments(row_start, q_offset=q_first))
    return dense_mask(pred, q_len, kv_len, row_start.device, batch=row_start.shape[0], key_offset=key_offset)


def check_aha(q, k, v, gate, window, row_start=None, gate_values=True, sinks=0) -> tuple[int, int, int]:
    """Every check of an AHA op's arguments; returns (q_len, kv_len, dim)."""
    _, _, lq, d, _, lk = check_qkv(q, k, v)
    check_gate(gate, q, gate_values)
    check_window(window)
    check_sinks(sinks)
    check_row_start(row_start, q)
    return lq, lk, d


def check_sinks(sinks: int) -> None:
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")


def check_window(window: int) -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, kv_heads, n, d] -> [batch, heads, n, d]; query head h reads kv head h // (heads // kv_heads)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def masked_attention_reference(q, k, v, mask, scale):
    """Dense softmax(q k^T * scale, masked) v in fp32, or in q's dtype where it is wider (the building block
    of the references), returned in that precision. mask: bool broadcastable to [b, h, lq, lk]."""
    heads, dtype = q.shape[1], torch.promote_types(q.dtype, torch.float32)
    s = (q.to(dtype) @ repeat_kv(k, heads).to(dtype).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, NEG_INF)
    p = torch.softmax(s, dim=-1)
    p = torch.where(mask.any(-1, keepdim=True), p, 0.0)  # a query that may see no key (padding) gives 0
    return p @ repeat_kv(v, heads).to(dtype)


__getattr__ = moved_names(__name__, {"masked_attention_fp32": (__name__, "masked_attention_reference")})
