"""AA-MoE attention ("Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin,
Eqs. 9-16; op family ``"aamoe"``): each query reads the m keys of every resource (a previous context chunk
or an expert's m memory slots) chosen for it, each resource's keys biased by the query's log P(i, j_k).

``aamoe_attention`` is the entry (routed by ``allhere.backend``); ``aamoe_attention_reference`` is the dense
reference (fp32, every key scored, the choice a mask); ``aamoe_attention_torch`` gathers the chosen chunks
and experts only, so its work grows with sum_i (B_i + own chunk) x m instead of L x (L + E m).
"""

from ..._deprecated import moved_names
from .dispatch import aamoe_attention
from .gathered import aamoe_attention_torch
from .reference import aamoe_attention_reference

__all__ = ["aamoe_attention", "aamoe_attention_reference", "aamoe_attention_torch"]

__getattr__ = moved_names(__name__, {"aamoe_attention_naive": (__name__, "aamoe_attention_reference")})
