"""The fused prefill path of ``"dar_latent"`` (CPU inference, no mask): the same far keys as the rebuilt path, but
no query-block loop. The far part is causal attention shifted by the window -- query i reads far keys
0..i + (lk - lq) - window -- so it is one or two calls of torch's fused CPU attention (flash-style, the scores never
stored); the near part is a band of ``window`` keys per query, one fused call over blocks of queries with the
keys their window spans. Each part comes with its log-sum-exp; the two are merged into one softmax in fp32.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from ...softmax import default_scale, merge_pair
from .check import check_latent_call, split_rows
from .reference import far_kv

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fused_applies(q, mask, *tensors) -> bool:
    """Whether the fused path may serve a call: no mask, on the CPU, in a dtype its kernel takes, and nothing to
    differentiate (it returns no gradient)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, *tensors))
    return mask is None and not grad and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def _attend(q, k, v, scale: float, causal: bool = False, bias=None):
    """softmax(q k^T x scale + bias) v and its log-sum-exp, fused: q [B, h, m, e], k [B, g, n, e], v [B, g, n, d]
    (query head i reads KV head i // (h / g)); causal: query i reads keys 0..i; bias: float, broadcastable to
    [B, h, m, n]. Returns ([B, h, m, d] in q's dtype, [B, h, m] fp32)."""
    e, d = q.shape[-1], v.shape[-1]
    if e != d:  # the kernel takes one head size: zero columns add nothing to a score; the extra outputs are cut
        q, k = (F.pad(t, (0, max(e, d) - e)) for t in (q, k))
        v = F.pad(v, (0, max(e, d) - d))
    out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    return out[..., :d], lse


def _tail_causal(q, k, v, scale: float):
    """Queries [B, h, m, e] at the last m of n key positions, query i reading keys 0..n - m + i: the keys before
    the queries unmasked, the rest causal. Needs n >= m. Returns (out [B, h, m, d], lse [B, h, m] fp32)."""
    m, n = q.shape[2], k.shape[2]
    last = _attend(q, k[:, :, n - m:], v[:, :, n - m:], scale, causal=True)
    return merge_pair(*last, *_attend(q, k[:, :, :n - m], v[:, :, :n - m], scale), fma=True) if n > m else last


def _band(q, k, v, window: int, scale: float, block: int):
    """Queries [b, h, lq, d] at the last lq of the ln positions of k, v [b, g, ln, d], query i reading the keys of
    positions (ln - lq + i - window, ln - lq + i]: blocks of ``block`` queries, each with the block + window - 1
    keys it spans, in one fused call with a band bias. Returns (out [b, h, lq, d], lse [b, h, lq] fp32)."""
    b, h, lq, d = q.shape
    g, ln = k.shape[1], k.shape[2]
    nb, span = -(-lq // block), block + window - 1
    # key slot t of the padded keys is position t + ln - lq - window + 1: query i's window is slots i..i + w - 1
    first = ln - lq - window + 1
    left, right = max(0, -first), nb * block + window - 1 - (ln - first)
    kp, vp = (F.pad(t[:, :, max(0, first):], (0, 0, left, max(0, right))) for t in (k, v))
    kb, vb = (t.unfold(2, span, block).permute(0, 2, 1, 4, 3).reshape(b * nb, g, span, d) for t in (kp, vp))
    qb = F.pad(q, (0, 0, 0, nb * block - lq)).view(b, h, nb, block, d).transpose(1, 2).reshape(b * nb, h, block, d)
    bias = _band_bias(nb, block, window, left, q.dtype).expand(b, nb, 1, block, span).reshape(b * nb, 1, block, span)
    out, lse = _attend(qb, kb, vb, scale, bias=bias)
    out = out.view(b, nb, h, block, d).transpose(1, 2).reshape(b, h, nb * block, d)[:, :, :lq]
    return out, lse.view(b, nb, h, block).transpose(1, 2).reshape(b, h, nb * block)[:, :, :lq]


@lru_cache(maxsize=8)  # every layer of a model's prefill asks for the same one
def _band_bias(nb: int, block: int, window: int, left: int, dtype: torch.dtype) -> torch.Tensor:
    """The band of ``_band``: [nb, 1, block, block + window - 1], 0 where query r of block n may read key slot
    n x block + c (r <= c < r + window, past the ``left`` padded slots), -inf elsewhere. Never written to."""
    r = torch.arange(block).view(1, -1, 1)
    c = torch.arange(block + window - 1).view(1, 1, -1)
    slot = torch.arange(nb).view(-1, 1, 1) * block + c
    allowed = (c >= r) & (c < r + window) & (slot >= left)  # a query always sees itself
    with torch.inference_mode(False), torch.no_grad():
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def dar_latent_attention_fused(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int,
                               scale: float | None = None, mask: torch.Tensor | None = None,
                               block: int = 64) -> torch.Tensor:
    """Same contract as ``dar_latent_attention_reference`` for calls ``fused_applies`` to (mask None; CPU; fp32 or
    bf16; no gradient); output in q's dtype; block: queries per block of the near band."""
    if mask is not None:
        raise ValueError("the fused path takes no mask")
    b, h, lq, d, g, lk = check_latent_call(q, q_far, k_near, v_near, rows, w_uk, w_uv, window)
    scale = default_scale(d, scale)
    ln = k_near.shape[2]
    parts, first_far = {}, max(0, window - (lk - lq))  # queries before first_far see no far key
    if window > 0:  # near: the band, or plain causal attention when every window reaches the first near key
        band = window < ln
        parts["near"] = _band(q, k_near, v_near, window, scale, block) if band else _tail_causal(
            q, k_near, v_near, scale)
    if first_far < lq:  # far: query i reads far keys 0..i + lk - lq - window of the lk - window there are
        k_far, v_far = far_kv(*split_rows(rows[:, :lk - window], g, w_uk.shape[2]), w_uk, w_uv)
        parts["far"] = _tail_causal(q_far[:, :, first_far:], k_far.to(q.dtype), v_far.to(q.dtype), scale)
    if len(parts) == 1:
        return next(iter(parts.values()))[0].to(q.dtype)
    (o_n, l_n), far = parts["near"], parts["far"]
    merged = merge_pair(o_n[:, :, first_far:], l_n[:, :, first_far:], *far, fma=True)[0].to(q.dtype)
    return torch.cat([o_n[:, :, :first_far], merged], dim=2) if first_far else merged
