"""The mask predicate itself: its type ``MaskFn``, the causal predicate, the ``and`` / ``or`` combinators
(which also combine the ``tiles`` block tests and the ``prepare`` hooks of their parts), and ``dense_mask``,
which evaluates any predicate on a grid of positions."""

from __future__ import annotations

from typing import Callable

import torch

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


causal.tiles = lambda b, h, ql, qh, kl, kh: kl <= qh  # noqa: E731  (exact: the rectangle's corner (qh, kl))


def and_masks(*preds: MaskFn) -> MaskFn:
    def pred(b, h, q_idx, kv_idx):
        out = preds[0](b, h, q_idx, kv_idx)
        for p in preds[1:]:
            out = out & p(b, h, q_idx, kv_idx)
        return out

    return _combined(pred, preds, torch.logical_and)  # tiles: a superset, both parts may hit different entries


def or_masks(*preds: MaskFn) -> MaskFn:
    def pred(b, h, q_idx, kv_idx):
        out = preds[0](b, h, q_idx, kv_idx)
        for p in preds[1:]:
            out = out | p(b, h, q_idx, kv_idx)
        return out

    return _combined(pred, preds, torch.logical_or)


def _combined(pred: MaskFn, preds, combine) -> MaskFn:
    """``pred`` with the ``tiles`` rule and the ``prepare`` of its parts."""
    tiles = _tiles_of(preds, combine)
    if tiles is not None:
        pred.tiles = tiles
    prepares = [p.prepare for p in preds if hasattr(p, "prepare")]
    if prepares:
        def prepare(heads: int, length: int, device=None) -> None:
            for f in prepares:
                f(heads, length, device)

        pred.prepare = prepare
    if any(getattr(p, "varies_by_head", False) for p in preds):
        pred.varies_by_head = True
    return pred


def _tiles_of(preds, combine):
    parts = [getattr(p, "tiles", None) for p in preds]
    if any(t is None for t in parts):
        return None

    def tiles(b, h, ql, qh, kl, kh):
        out = parts[0](b, h, ql, qh, kl, kh)
        for t in parts[1:]:
            out = combine(out, t(b, h, ql, qh, kl, kh))
        return out

    return tiles


def with_tiles(pred: MaskFn, name: str, tiles=None) -> MaskFn:
    """``pred`` named ``name``, with its block test ``tiles`` (see the package docstring) when given."""
    pred.__name__ = name
    if tiles is not None:
        pred.tiles = tiles
    return pred


def check_count(name: str, value, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``, else ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def dense_mask(pred: MaskFn, q_len: int, kv_len: int, device=None, q_offset: int | None = None,
               batch: int = 1, heads: int = 1, key_offset: int = 0) -> torch.Tensor:
    """Evaluate ``pred`` on a grid: bool tensor [batch, heads, q_len, kv_len].

    The keys sit at absolute positions ``key_offset`` .. ``key_offset + kv_len - 1`` (a rolling cache that
    dropped older keys has ``key_offset`` > 0); the queries are the last ``q_len`` of them (bottom-right
    alignment, as in a KV cache) unless ``q_offset`` says where the first query sits.
    """
    off = key_offset + kv_len - q_len if q_offset is None else q_offset
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1) + off
    k = torch.arange(kv_len, device=device).view(1, 1, 1, -1) + key_offset
    return pred(b, h, q, k).expand(batch, heads, q_len, kv_len)
