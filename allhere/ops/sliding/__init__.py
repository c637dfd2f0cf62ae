from .blocked import sliding_window_attention
from .naive import sliding_window_attention_naive

__all__ = ["sliding_window_attention", "sliding_window_attention_naive"]
