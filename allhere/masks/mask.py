"""The mask type: a predicate together with everything known about it block by block (``Mask``), and
``as_mask`` for a plain predicate function a user hands in."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (b, h, q_lo, q_hi, k_lo, k_hi) -> bool, on rectangles of positions (inclusive bounds, broadcastable tensors)
BlockTest = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     torch.Tensor]
Prepare = Callable[..., None]  # prepare(heads, length, device=None)


@dataclass(frozen=True, eq=False, repr=False)
class Mask:
    """A mask predicate ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend) with its block information.
    Called like its predicate, so it goes wherever a predicate goes (``dense_mask``, FlexAttention's
    ``mask_mod``, vmap).

    - ``tiles``: for rectangles of positions, whether the rectangle may hold an allowed entry. A superset:
      it may say True for a rectangle with none, never False for one with some. None: no such test (a
      consumer evaluates the predicate instead).
    - ``dense``: whether every entry of the rectangle is allowed. A subset: it may say False for a
      rectangle whose entries are all allowed, never True for one with a masked entry. None: no such test.
    - ``per_head``: the pattern differs between heads (one FlexAttention block mask per head).
    - ``prepare(heads, length, device)``: fills the tables the predicate reads for that many heads and
      positions and copies them to ``device``, before the predicate is traced (vmap, torch.compile), which
      can neither grow a table nor copy one. None: it reads no table.
    - ``name``: what plans and reports call it.

    ``pred`` is always a plain callable, never a ``Mask`` (one is unwrapped): the combinators close over
    plain functions, as FlexAttention lifts the tensors a ``mask_mod``'s closures capture."""

    pred: MaskFn
    tiles: BlockTest | None = None
    dense: BlockTest | None = None
    per_head: bool = False
    prepare: Prepare | None = None
    name: str = "mask"

    def __post_init__(self) -> None:
        if isinstance(self.pred, Mask):
            object.__setattr__(self, "pred", self.pred.pred)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.pred(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"Mask({self.name})"

    def named(self, name: str) -> Mask:
        """The same mask under another name."""
        return replace(self, name=name)


def as_mask(pred: MaskFn | Mask) -> Mask:
    """``pred`` if it is a ``Mask``; a plain predicate function becomes one without block tests (consumers
    then evaluate it where they would have asked them). To give a predicate of one's own its block tests,
    build the ``Mask`` directly."""
    if isinstance(pred, Mask):
        return pred
    if not callable(pred):
        raise TypeError(f"a mask must be a Mask or a predicate (b, h, q_idx, kv_idx) -> bool, got "
                        f"{type(pred).__name__}")
    return Mask(pred, name=getattr(pred, "__name__", "predicate"))
