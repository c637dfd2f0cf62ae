"""Deprecated: ``allhere.mechanisms.pattern`` moved to ``allhere.mechanisms.masked_base`` (the base of the
mechanisms that attend under a fixed mask predicate). This module only re-exports its names."""

from .._moved import warn_moved
from .masked_base import PatternAttention, check_dilation

warn_moved("allhere.mechanisms.pattern", "import PatternAttention and check_dilation from "
           "allhere.mechanisms.masked_base")

__all__ = ["PatternAttention", "check_dilation"]
