"""Put a converted folder's mechanism on vLLM's model, as its kind's ``allhere.registry.Serving`` says
(``allhere.serve.serving``): refuse what it does not serve (the kind, the device, the family), check what it needs
of vLLM (its own KV cache group: the hybrid KV cache manager), refuse converted layers whose softmax terms it does
not compute, then run the installer it names on every converted layer.

``INSTALLERS`` (by ``Serving.installer``; each ``(block, attn, cfg, at)``: the layer's attention block, its vLLM
``Attention``, the kind's config object from ``allhere.registry.from_dict``, and the layer's ``Site``):

- "aha": the router and allhere's attention over the layer's paged cache (``allhere.serve.vllm.layers``); off the
  CPU through allhere's Triton paged kernel, refused where that kernel cannot take the layer;
- "sliding": the layer's ``Attention`` rebuilt with ``per_layer_sliding_window = window`` (vLLM then keeps a
  sliding-window KV cache for it and runs its own kernel);
- "sinks": the ``Attention`` rebuilt to report a KV cache group of its own (``allhere.serve.vllm.sink_cache``: the sink
  blocks and the window's), read as a masked pattern;
- "dar": the window's cache and a latent cache (``allhere.serve.vllm.dar``);
- "dar_latent": the window's cache and a cache of latent rows (``allhere.serve.vllm.dar_latent``);
- "masked": allhere's attention over the layer's paged cache under the config's ``mask_fn`` (any causal pattern:
  a new one needs no change here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.transformers import TransformersForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from ... import registry
from ...hosts import CONFIG_KEY, LAYERS_KEY
from ...ops.paged.aha_triton import kernel_refusal
from .. import serving
from .attention import host_softmax_terms, refuse_softmax_terms
from .blocks import rebuild_attention
from .cpu_kernels import VLLM_WINDOW_OFFSET
from .dar import install_dar
from .dar_latent import install_dar_latent
from .layers import install_aha, install_masked
from .sink_cache import SinkAttention


@dataclass
class Site:
    """Where a layer is installed: its index, the folder's transformers config, vLLM's config, and every layer's
    (block, ``Attention``) with the converted layers' indices."""

    index: int
    config: Any
    vllm_config: Any
    blocks: dict[int, tuple[nn.Module, Attention]]
    layers: list[int]


def _aha(block, attn, cfg, at: Site) -> None:
    if at.vllm_config.device_config.device_type != "cpu":
        _check_aha_kernel(at.vllm_config, attn, at.index)
    install_aha(block, attn, cfg, at.config.hidden_size, at.config.num_attention_heads).layer = at.index


def _sliding(block, attn, cfg, at: Site) -> None:
    rebuild_attention(block, attn, per_layer_sliding_window=cfg.window + VLLM_WINDOW_OFFSET)


def _sinks(block, attn, cfg, at: Site) -> None:
    _check_sinks(at.blocks, at.layers, cfg.window)
    install_masked(block, rebuild_attention(block, attn, SinkAttention, window=cfg.window, n_sinks=cfg.n_sinks), cfg)


def _dar(block, attn, cfg, at: Site) -> None:
    install_dar(block, attn, cfg, at.config.hidden_size)


def _dar_latent(block, attn, cfg, at: Site) -> None:
    install_dar_latent(block, attn, cfg, at.config.hidden_size)


def _masked(block, attn, cfg, at: Site) -> None:
    install_masked(block, attn, cfg)


INSTALLERS = {"aha": _aha, "sliding": _sliding, "sinks": _sinks, "dar": _dar, "dar_latent": _dar_latent,
              "masked": _masked}


def attention_blocks(model: nn.Module) -> dict[int, tuple[nn.Module, Attention]]:
    """layer index -> (attention block, its vLLM Attention child ``attn``), found by structure."""
    found = {}
    for name, module in model.named_modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, Attention):
            found[extract_layer_index(attn.layer_name)] = (module, attn)
    return found


def install(model: nn.Module, config) -> list[int]:
    """Put the mechanism of ``config`` (a converted folder's transformers config) on ``model``'s converted
    layers; returns their indices. No-op (returns []) for a config without allhere settings."""
    settings = getattr(config, CONFIG_KEY, None)
    if settings is None:
        return []
    kind = settings.get("kind") if isinstance(settings, dict) else None
    vllm_config = get_current_vllm_config()
    arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    why = serving.refusal(kind, vllm_config.device_config.device_type, arch,
                          isinstance(model, TransformersForCausalLM))
    if why is not None:
        raise NotImplementedError(f"allhere vLLM serving: {why}")
    spec, cfg = serving.spec(kind), registry.from_dict(settings)
    if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise NotImplementedError("allhere vLLM serving: tensor / pipeline parallelism is not supported yet")
    blocks = attention_blocks(model)
    layers = list(getattr(config, LAYERS_KEY, None) or sorted(blocks))
    missing = [i for i in layers if i not in blocks]
    if missing:
        raise ValueError(f"allhere vLLM serving: converted layers {missing} have no vLLM Attention")
    if spec.own_cache_group is not None and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise NotImplementedError(f"allhere vLLM serving: {kind} needs vLLM's hybrid KV cache manager "
                                  f"({spec.own_cache_group}), which is disabled here")
    put = INSTALLERS[spec.installer]
    for i in layers:
        block, attn = blocks[i]
        # a window as long as the context (Phi-4-mini's 262144) is no window: allhere converted the layer as full
        if attn.sliding_window is not None and attn.sliding_window < config.max_position_embeddings:
            raise NotImplementedError(f"allhere vLLM serving: layer {i} already has a sliding window")
        if not spec.softmax_terms:
            refuse_softmax_terms(attn)
        put(block, attn, cfg, Site(i, config, vllm_config, blocks, layers))
    return layers


def _check_sinks(blocks: dict, layers: list[int], window: int) -> None:
    """Sinks free the blocks between the sinks and the window through a KV cache group of their own: no vLLM
    sliding layer may have the same window (vLLM would put both in the sliding layers' group, which frees the
    sink blocks)."""
    same = [i for i, (_, a) in blocks.items() if i not in layers and a.sliding_window == window + VLLM_WINDOW_OFFSET]
    if same:
        raise NotImplementedError(f"allhere vLLM serving: sinks with window {window}, the window of the model's own "
                                  f"sliding layers {same}: convert with another window")


def _check_aha_kernel(vllm_config, attn: Attention, i: int) -> None:
    """Raise where AHA layer ``i`` off the CPU cannot run allhere's Triton paged kernel."""
    device = vllm_config.device_config.device_type
    why = kernel_refusal(attn.head_size, torch.device(device), *host_softmax_terms(attn))
    if why is None and vllm_config.cache_config.cache_dtype != "auto":
        why = f"a KV cache of {vllm_config.cache_config.cache_dtype} (the kernel reads the model's dtype)"
    if why is None and not vllm_config.model_config.enforce_eager:
        why = ("CUDA graphs would replay the kernel's launch grids of the captured step (start vLLM with "
               "--enforce-eager, as allhere serve does)")
    if why is not None:
        raise NotImplementedError(f"allhere vLLM serving: AHA on {device} runs allhere's Triton paged kernel, which "
                                  f"cannot take layer {i}: {why}")
