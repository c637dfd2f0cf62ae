"""Window masks: the sliding window (the project's one window definition), the dilated window, and
attention sinks with the window they go with (StreamingLLM)."""

from __future__ import annotations

import torch

from .mask import Mask
from .predicates import check_count, or_masks
from .tables import DeviceTables


def sliding_window(window: int, causal: bool = True) -> Mask:
    """Causal window of ``window`` keys, the current one included; with ``causal=False`` (an encoder)
    ``window - 1`` keys on each side: ``|q - k| < window``. Its block tests are exact: a rectangle's
    differences q - k fill [ql - kh, qh - kl]."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    if causal:
        def pred(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    else:
        def pred(b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return (d < window) & (d > -window)

    lowest = 0 if causal else 1 - window  # the smallest difference allowed

    def tiles(b, h, ql, qh, kl, kh):  # some difference in range
        return (qh - kl >= lowest) & (ql - kh < window)

    def dense(b, h, ql, qh, kl, kh):  # every difference in range
        return (ql - kh >= lowest) & (qh - kl < window)

    return Mask(pred, tiles, dense, name=f"sliding_window_{window}" + ("" if causal else "_bidir"))


def _range_hits(diff_lo, diff_hi, step, count):
    """Whether some m in [0, count) has m * step in [diff_lo, diff_hi] (step >= 1; tensors broadcast)."""
    lo = diff_lo.clamp_min(0)
    m = (lo + step - 1) // step
    return (diff_hi >= lo) & (m < count) & (m * step <= diff_hi)


def dilated_window(window: int, dilation=1, causal: bool = True) -> Mask:
    """``window`` keys at stride ``dilation``: q - k in {0, d, 2d, ..., (window-1) d} (span (window-1) d + 1),
    or |q - k| in that set when ``causal=False``. ``dilation``: an int, or a tuple of one int per query head
    (indexed by the predicate's ``h``: Longformer's per-head dilation, "Longformer: The Long-Document
    Transformer", arXiv:2004.05150). ``dilation=1`` is ``sliding_window``."""
    check_count("window", window, 1)
    per_head = isinstance(dilation, (tuple, list))
    dils = tuple(dilation) if per_head else (dilation,)
    if not dils:
        raise ValueError("dilation must be an integer >= 1 or a non-empty tuple of them")
    for d in dils:
        check_count("dilation", d, 1)
    # int32, as FlexAttention's positions: a kernel dividing by an int64 stride runs 64-bit divisions
    table = DeviceTables(d=torch.tensor(dils, dtype=torch.int32))

    def step(h, like):
        if not per_head:
            return dils[0]
        return table.get("d", like)[torch.as_tensor(h, device=like.device)]

    def pred(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        if not causal:
            diff = diff.abs()
        if dils == (1,):  # a sliding window: no division
            return (diff >= 0) & (diff < window)
        d = step(h, q_idx)
        return (diff >= 0) & (diff % d == 0) & (diff <= (window - 1) * d)

    def tiles(b, h, ql, qh, kl, kh):
        d = step(h, ql)
        lo, hi = ql - kh, qh - kl  # every difference in between occurs in the rectangle
        ahead = _range_hits(lo, hi, d, window)
        return ahead if causal else ahead | _range_hits(-hi, -lo, d, window)

    name = f"dilated_window_{window}_{'x'.join(map(str, dils))}" + ("" if causal else "_bidir")
    return Mask(pred, tiles, per_head=per_head, prepare=table.prepare if per_head else None, name=name)


def sinks(n_sinks: int, causal: bool = True) -> Mask:
    """Attention sinks: every query sees the keys at positions < ``n_sinks`` (earlier ones if causal), as in
    StreamingLLM ("Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453). A
    component: ``sliding_with_sinks`` ORs it with a window."""
    check_count("n_sinks", n_sinks, 0)

    def pred(b, h, q_idx, kv_idx):
        out = kv_idx < n_sinks
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        out = kl < n_sinks
        return out & (kl <= qh) if causal else out

    return Mask(pred, tiles, name=f"sinks_{n_sinks}" + ("" if causal else "_bidir"))


def sliding_with_sinks(window: int, n_sinks: int, causal: bool = True) -> Mask:
    """StreamingLLM's pattern (arXiv:2309.17453): the window of ``window`` keys OR the first ``n_sinks`` keys."""
    mask = or_masks(sliding_window(window, causal=causal), sinks(n_sinks, causal=causal))
    return mask.named(f"sliding_{window}_sinks_{n_sinks}" + ("" if causal else "_bidir"))
