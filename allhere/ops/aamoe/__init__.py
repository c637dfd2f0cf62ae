"""AA-MoE attention ("Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin,
Eqs. 9-16): each query reads the m keys of every resource (a previous context chunk or an expert's m
memory slots) chosen for it, each resource's keys biased by the query's log P(i, j_k).

``aamoe_attention_naive`` is the dense reference (fp32, every key scored, the choice a mask);
``aamoe_attention`` gathers the chosen chunks and experts only, so its work grows with
sum_i (B_i + own chunk) x m instead of L x (L + E m).
"""

from .gathered import aamoe_attention
from .naive import aamoe_attention_naive

__all__ = ["aamoe_attention", "aamoe_attention_naive"]
