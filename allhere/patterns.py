"""Deprecated: ``allhere.patterns`` moved. The global-token flags (``global_first``, ``global_at``,
``global_from_ids``) are in ``allhere.masks`` (file ``allhere/masks/global_positions.py``) and the dense
reference of a predicate (``reference_attention``) is in ``allhere.ops.full``. This module only re-exports
them."""

from ._moved import warn_moved
from .masks import global_at, global_first, global_from_ids
from .ops.full import reference_attention

warn_moved("allhere.patterns", "import global_first, global_at and global_from_ids from allhere.masks "
           "(allhere/masks/global_positions.py), and reference_attention from allhere.ops.full")

__all__ = ["global_at", "global_first", "global_from_ids", "reference_attention"]
