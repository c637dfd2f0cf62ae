"""The block structures of the sparse-pattern layers -- the block-sparse op's tile plan and FlexAttention's
BlockMask -- built once per (pattern, call shape) and shared by every layer with that pattern.

A model of L layers with one pattern builds one structure for all of them, not one per layer: without
segment boundaries once in all, with them (padded batches, packed documents, which change with every
batch) once per forward, where each layer used to build its own at every call. Every layer of a forward
gets the same ``segment_starts`` tensor (the Decoder and the Hugging Face mask hand one object to all
layers), so an entry built for segments is found again by that tensor's identity: the cache holds it,
so its id cannot be reused while the entry lives. Starts are built per batch and never modified in
place.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class BlockCache:
    """Least-recently-used block structures: ``size`` entries for calls without segment boundaries and
    ``segment_size`` for calls with them (those are of use within one forward only, and at 32k tokens a
    batch's BlockMask is tens of MB on the device)."""

    def __init__(self, size: int = 8, segment_size: int = 2) -> None:
        self.size, self.segment_size = size, segment_size
        self._plain: OrderedDict = OrderedDict()
        self._segments: OrderedDict = OrderedDict()
        self.builds = 0  # structures built so far (what sharing saves shows here)

    def get(self, key, build: Callable[[], object], starts=None):
        """The structure of ``key`` (hashable: pattern and call shape) for these segment ``starts`` (a tensor
        or None), made by ``build()`` when not held."""
        table, size = (self._plain, self.size) if starts is None else (self._segments, self.segment_size)
        full = key if starts is None else (key, id(starts))
        held = table.get(full)
        if held is not None and held[0] is starts:
            table.move_to_end(full)
            return held[1]
        value = build()
        self.builds += 1
        table[full] = (starts, value)
        while len(table) > size:
            table.popitem(last=False)
        return value

    def clear(self) -> None:
        self._plain.clear()
        self._segments.clear()
