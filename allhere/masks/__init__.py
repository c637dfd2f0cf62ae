"""Attention masks: predicates ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend) with their block tests.

The same predicate feeds the dense references (``dense_mask``), FlexAttention and any plot of the
pattern. Indices are absolute token positions. Predicates work on broadcastable integer tensors, so
they are written with tensor operators (``&``, ``|``), never ``and``/``or``.

The one window definition of the project: window ``w`` = the ``w`` most recent keys including the
current token, i.e. ``0 <= q_idx - kv_idx < w`` (Eq. 4 of the AHA paper; Hugging Face ``sliding_window=w``;
flash-attn ``window_size=(w - 1, 0)``).

Every factory of the sparse family (sinks, dilated windows, global tokens, Longformer, BigBird) takes
``causal`` (default True). With ``causal=False`` (an encoder) a window of ``w`` reaches ``w - 1`` keys on
each side (``|q - k| < w``) and global tokens see / are seen by every position.

Every factory returns a ``Mask`` (``mask``), the one home of a pattern's block information: its
predicate, called like it, together with

- ``tiles(b, h, q_lo, q_hi, k_lo, k_hi)``: for rectangles of positions (inclusive bounds, broadcastable
  integer tensors) whether the rectangle may hold an allowed entry. A superset: it may say True for an
  empty rectangle, never False for a non-empty one. The block-sparse op (``allhere.ops.blocksparse``), the
  ring and the paged serving op use it to find the blocks to compute without evaluating the predicate on
  all n x n positions;
- ``dense(...)``: whether every entry of the rectangle is allowed. A subset: it may say False for a whole
  rectangle, never True for one with a masked entry (the paged serving op reads such blocks unmasked).
  Exact for ``causal`` and ``sliding_window``;
- ``per_head``: the pattern differs between heads;
- ``prepare(heads, length, device)`` for a mask that reads tables (per-head dilations, global-token flags,
  BigBird's random blocks): it fills them for that many heads and positions and copies them to ``device``
  before the predicate is traced (FlexAttention's ``create_block_mask`` vmaps it and its compiled kernels
  read captured tensors on their own device only).

A test a mask does not have is None, and its consumers evaluate the predicate instead. ``and_masks`` /
``or_masks`` combine all of it (see there); ``as_mask`` turns a plain predicate function into a ``Mask``
without block tests, and every consumer takes either.

The package, by what each file holds:

- ``mask``: ``Mask``, ``as_mask``, ``MaskFn`` (a plain predicate's type);
- ``predicates``: ``causal``, ``and_masks`` / ``or_masks``, ``dense_mask``;
- ``segments``: sequence boundaries (``segment_starts``, ``starts_from``, ``within_segments``) and the sinks
  of each segment (``segment_sinks``);
- ``windows``: ``sliding_window``, ``dilated_window``, ``sinks``, ``sliding_with_sinks``;
- ``global_positions``: global-token flags (``global_first``, ``global_at``, ``global_from_ids``),
  ``global_tokens`` and ``longformer``;
- ``bigbird_blocks``: ``bigbird_window``, ``bigbird_global``, ``BigBirdRandom`` / ``bigbird_random``,
  ``bigbird``;
- ``tables``: the per-device lookup tables behind ``prepare`` (internal).

Import the names from ``allhere.masks`` itself; the file a name lives in may change (allhere's ops import each
from its file, which keeps their chains of imports short).
"""

from .bigbird_blocks import BigBirdRandom, bigbird, bigbird_global, bigbird_random, bigbird_window
from .global_positions import global_at, global_first, global_from_ids, global_tokens, longformer
from .mask import Mask, MaskFn, as_mask
from .predicates import and_masks, causal, dense_mask, or_masks
from .segments import segment_sinks, segment_starts, starts_from, within_segments
from .windows import dilated_window, sinks, sliding_window, sliding_with_sinks

__all__ = [
    "BigBirdRandom", "Mask", "MaskFn", "and_masks", "as_mask", "bigbird", "bigbird_global", "bigbird_random",
    "bigbird_window", "causal", "dense_mask", "dilated_window", "global_at", "global_first", "global_from_ids",
    "global_tokens", "longformer", "or_masks", "segment_sinks", "segment_starts", "sinks", "sliding_window",
    "sliding_with_sinks",
    "starts_from", "within_segments",
]
