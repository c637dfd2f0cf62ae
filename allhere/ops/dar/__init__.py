from .blocked import dar_attention
from .naive import dar_attention_naive

__all__ = ["dar_attention", "dar_attention_naive"]
