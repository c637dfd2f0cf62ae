from .naive import dar_attention_naive

__all__ = ["dar_attention_naive"]
