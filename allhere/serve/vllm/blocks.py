"""A converted layer's vLLM attention block: its ``Attention`` built again with another KV cache spec
(``rebuild_attention``), and an argument of its call found by name whichever way the family passes it
(``block_argument``)."""

from __future__ import annotations

import inspect

from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention


def rebuild_attention(block: nn.Module, attn: Attention, cls=Attention, **kwargs) -> Attention:
    """The layer's vLLM ``Attention`` built again as ``cls`` with ``kwargs`` (its cache spec changes)."""
    vllm_config = get_current_vllm_config()
    vllm_config.compilation_config.static_forward_context.pop(attn.layer_name)  # the same name, rebuilt
    block.attn = cls(attn.num_heads, attn.head_size, attn.impl.scale, num_kv_heads=attn.num_kv_heads,
                     cache_config=vllm_config.cache_config, prefix=attn.layer_name, **kwargs)
    return block.attn


def block_argument(block, args, kwargs, name: str):
    """(where, key) of the attention block's argument ``name`` in this call: ``kwargs`` and the name, or
    ``args`` and its index (families differ: Llama's blocks take (positions, hidden_states), gpt-oss's
    (hidden_states, positions), either by position or by keyword)."""
    if name in kwargs:
        return kwargs, name
    params = [p for p in inspect.signature(type(block).forward).parameters if p != "self"]
    return args, params.index(name)
