"""The attention function and mask function that AHA registers with ``transformers``.

The model's own attention module projects q/k/v, applies its own normalisation and rotary embedding
(OLMo-2's q/k norm over all heads, GPT-NeoX's partial rotary, grouped-query heads) and updates the KV
cache; then it calls the function registered under ``ATTN_NAME`` with the post-RoPE query [b, h, q, d]
and the whole cached keys/values [b, kv_heads, kv, d]. The router's input (the attention block's input
X) is handed over by a forward pre-hook on the attention module (see ``convert``).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "allhere_aha"


def aha_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          **kwargs):
    """transformers attention-interface signature; returns (output [b, q, h, d], None)."""
    mech = module.aha
    if dropout:
        raise NotImplementedError("allhere AHA attention does not implement attention dropout; set it to 0")
    x = mech.pop_input()
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    if mask is not None and mask.dtype != torch.bool:  # additive float mask -> boolean
        mask = mask > torch.finfo(mask.dtype).min / 2
    out, routing = mech(query, key, value, x, scale=scaling, mask=mask)
    mech.last_routing = routing
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Idempotent: make ``attn_implementation="allhere_aha"`` known to transformers."""
    AttentionInterface.register(ATTN_NAME, aha_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
