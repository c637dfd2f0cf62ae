"""Attention masks as predicates ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend).

The same predicate feeds the dense references (``dense_mask``), FlexAttention and any plot of the
pattern. Indices are absolute token positions. Predicates work on broadcastable integer tensors, so
they are written with tensor operators (``&``, ``|``), never ``and``/``or``.

The one window definition of the project: window ``w`` = the ``w`` most recent keys including the
current token, i.e. ``0 <= q_idx - kv_idx < w`` (Eq. 4 of the AHA paper; Hugging Face ``sliding_window=w``;
flash-attn ``window_size=(w - 1, 0)``).

Every factory of the sparse family (sinks, dilated windows, global tokens, Longformer, BigBird) takes
``causal`` (default True). With ``causal=False`` (an encoder) a window of ``w`` reaches ``w - 1`` keys on
each side (``|q - k| < w``) and global tokens see / are seen by every position.

Besides being a predicate, each factory's result carries a block test
``tiles(b, h, q_lo, q_hi, k_lo, k_hi)``: for rectangles of positions (inclusive bounds, broadcastable
integer tensors) whether the rectangle may hold an allowed entry. It may say True for an empty rectangle
(a superset), never False for a non-empty one; the block-sparse op (``allhere.ops.blocksparse``) and the
ring use it to find the blocks to compute without evaluating the predicate on all n x n positions.

A predicate that reads tables (per-head dilations, global-token flags, BigBird's random blocks) has
``prepare(heads, length, device)``: it fills its tables for that many heads and positions and copies them
to ``device`` before the predicate is traced (FlexAttention's ``create_block_mask`` vmaps it and its
compiled kernels read captured tensors on their own device only). One whose pattern differs between heads
says ``varies_by_head = True``. ``and_masks`` / ``or_masks`` pass ``tiles``, ``prepare`` and
``varies_by_head`` on.

The package, by what each file holds:

- ``predicates``: ``MaskFn``, ``causal``, ``and_masks`` / ``or_masks``, ``dense_mask``;
- ``segments``: sequence boundaries (``segment_starts``, ``starts_from``, ``within_segments``);
- ``windows``: ``sliding_window``, ``dilated_window``, ``sinks``, ``sliding_with_sinks``;
- ``global_positions``: global-token flags (``global_first``, ``global_at``, ``global_from_ids``),
  ``global_tokens`` and ``longformer``;
- ``bigbird_blocks``: ``bigbird_window``, ``bigbird_global``, ``BigBirdRandom`` / ``bigbird_random``,
  ``bigbird``;
- ``tables``: the per-device lookup tables behind ``prepare`` (internal).

Import the names from ``allhere.masks`` itself; the file a name lives in may change.
"""

from .bigbird_blocks import BigBirdRandom, bigbird, bigbird_global, bigbird_random, bigbird_window
from .global_positions import global_at, global_first, global_from_ids, global_tokens, longformer
from .predicates import MaskFn, and_masks, causal, dense_mask, or_masks
from .segments import segment_starts, starts_from, within_segments
from .windows import dilated_window, sinks, sliding_window, sliding_with_sinks

__all__ = [
    "BigBirdRandom", "MaskFn", "and_masks", "bigbird", "bigbird_global", "bigbird_random", "bigbird_window",
    "causal", "dense_mask", "dilated_window", "global_at", "global_first", "global_from_ids", "global_tokens",
    "longformer", "or_masks", "segment_starts", "sinks", "sliding_window", "sliding_with_sinks", "starts_from",
    "within_segments",
]
