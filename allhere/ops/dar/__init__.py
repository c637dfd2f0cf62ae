"""DAR attention (op family ``"dar"``): ``dar_attention`` is the entry; the paths are
``dar_attention_reference`` (dense fp32) and ``dar_attention_torch`` (query blocks)."""

from ..._deprecated import moved_names
from .blocked import dar_attention_torch
from .dispatch import dar_attention
from .reference import dar_attention_reference

__all__ = ["dar_attention", "dar_attention_reference", "dar_attention_torch"]

__getattr__ = moved_names(__name__, {"dar_attention_naive": (__name__, "dar_attention_reference")})
