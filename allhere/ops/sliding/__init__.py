"""Sliding-window attention (op family ``"sliding"``): ``sliding_window_attention`` is the entry; the paths
are ``sliding_window_attention_reference`` (dense fp32) and ``sliding_window_attention_torch`` (blocked)."""

from ..._deprecated import moved_names
from .blocked import sliding_window_attention_torch
from .dispatch import sliding_window_attention
from .reference import sliding_window_attention_reference

__all__ = ["sliding_window_attention", "sliding_window_attention_reference", "sliding_window_attention_torch"]

__getattr__ = moved_names(__name__, {
    "sliding_window_attention_naive": (__name__, "sliding_window_attention_reference")})
