"""Shared helpers of the attention ops: shape checks, dense masked attention in fp32."""

from __future__ import annotations

import math

import torch


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


def check_gate(gate: torch.Tensor, q: torch.Tensor) -> None:
    if tuple(gate.shape) != tuple(q.shape[:3]):
        raise ValueError(f"gate must be [batch, heads, q_len] = {tuple(q.shape[:3])}, got {tuple(gate.shape)}")


def check_window(window: int) -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")


def default_scale(d: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if scale is None else scale


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, kv_heads, n, d] -> [batch, heads, n, d]; query head h reads kv head h // (heads // kv_heads)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def masked_attention_fp32(q, k, v, mask, scale):
    """Dense softmax(q k^T * scale, masked) v in fp32. mask: bool broadcastable to [b, h, lq, lk]."""
    heads = q.shape[1]
    s = (q.float() @ repeat_kv(k, heads).float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(mask.any(-1, keepdim=True), p, 0.0)  # a query that may see no key (padding) gives 0
    return p @ repeat_kv(v, heads).float()


def combine_gated(hard: torch.Tensor, gate: torch.Tensor, a_full: torch.Tensor, a_local: torch.Tensor):
    """Per (batch, head, token): a_full where the hard gate is 1, else a_local.

    If ``gate`` is a float tensor that requires grad (a straight-through gate), the value is unchanged
    (``gate - gate.detach()`` is exactly zero) but d out / d gate = a_full - a_local, so
    dL/dgate = sum over dim of dL/da * (a_full - a_local): seeds/003 Eq. 3.
    """
    out = torch.where(hard[..., None], a_full, a_local)
    if gate.dtype != torch.bool and gate.requires_grad:
        out = out + (gate - gate.detach()).to(out.dtype)[..., None] * (a_full - a_local)
    return out


def hard_gate(gate: torch.Tensor) -> torch.Tensor:
    """bool gate from a bool or 0/1 (possibly straight-through float) gate."""
    return gate if gate.dtype == torch.bool else gate.detach() > 0.5
