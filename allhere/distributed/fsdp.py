"""Data-parallel sharding with FSDP2 (``torch.distributed.fsdp.fully_shard``): each transformer block is
its own unit (its parameters are gathered just before it runs and freed after), then the root takes the
rest (embeddings, final norm, head). Mixed precision (bf16 parameters in compute, fp32 gradient
reduction) only on CUDA; on CPU everything stays fp32."""

from __future__ import annotations

import torch
from torch import nn


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: our Decoder's ``blocks``; otherwise (a Hugging Face model) the longest
    ``nn.ModuleList`` of modules of one type (its decoder layers)."""
    if isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return list(model.blocks)
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(x) for x in m}) == 1:
            best = list(m)
    return best


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 already shards ``model`` or a module inside it (e.g. the transformers model that
    ``allhere.hf.HFCausalLM`` wraps, loaded by ``allhere.hf.sharded_load``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_model(model: nn.Module, device: str, mesh=None) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (a 1-D DeviceMesh; default: every rank of the default process
    group); a no-op if it, or a module inside it, already is sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_sharded(model):
        return model
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if device.startswith("cuda") else MixedPrecisionPolicy())
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
