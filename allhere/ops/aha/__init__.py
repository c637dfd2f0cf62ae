from .fast import aha_attention_fast
from .naive import aha_attention_naive

__all__ = ["aha_attention_fast", "aha_attention_naive"]
