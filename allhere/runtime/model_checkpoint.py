"""Checkpoints: one safetensors file (model and optimizer tensors) with the JSON state in its metadata,
plus a readable JSON copy beside it. Written atomically (temporary file, then rename), so a crash never
leaves a half-written checkpoint in place of a good one. Loading never unpickles anything.

Tied weights (a model whose output head shares the input embedding's tensor, as Llama-3.2, Qwen2.5, Qwen3
and SmolLM2 do) are stored once: safetensors refuses two names for one storage. The metadata lists each
other name (``shared``: alias -> stored name) and loading hands the stored tensor to both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..validation import ConfigError


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or does not fit. The message names the file."""


def atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    state: dict[str, Any]) -> None:
    """state: JSON-serialisable (step, configs, metrics). ``model.cfg`` is stored as ``model_config``."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors, shared = {}, {}
    first_name: dict[tuple, str] = {}  # (storage, offset, shape, stride) -> the first name holding it
    for k, v in model.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.device)
        if v.numel() and key in first_name:  # the same tensor under a second name (tied weights)
            shared[f"model.{k}"] = first_name[key]
            continue
        first_name[key] = f"model.{k}"
        tensors[f"model.{k}"] = v.detach().contiguous().cpu()
    meta = dict(state, model_config=model.cfg.to_dict())
    if shared:
        meta["shared"] = shared
    if optimizer is not None:
        osd = optimizer.state_dict()
        for idx, st in osd["state"].items():
            for key, val in st.items():
                tensors[f"optim.{idx}.{key}"] = torch.as_tensor(val).detach().contiguous().cpu()
        meta["optim_param_groups"] = osd["param_groups"]
    text = json.dumps(meta, indent=1, sort_keys=True)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"allhere": text}))
    atomic_write(path.with_suffix(".json"), lambda tmp: tmp.write_text(text + "\n"))


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["allhere"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors.update({alias: tensors[stored] for alias, stored in meta.get("shared", {}).items()})
    except Exception as e:  # safetensors raises several types for a damaged file
        raise CheckpointError(f"checkpoint {path} is corrupt or not an allhere safetensors file ({e})") from e
    return tensors, meta


def load_model(path: str | Path, device: str = "cpu"):
    """Rebuild the Decoder stored in a checkpoint (config and weights)."""
    from ..model import Decoder

    tensors, meta = read_checkpoint(path)
    try:
        model = Decoder(ModelConfig.from_dict(meta["model_config"]))
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"checkpoint {path} holds no valid model config ({e})") from e
    restore_model(model, tensors, path)
    return model.to(device), meta


def restore_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor], path) -> None:
    sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not fit the model: {e}") from e


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict, path) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = t
    try:
        optimizer.load_state_dict({"state": state, "param_groups": meta["optim_param_groups"]})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has no usable optimizer state ({e})") from e
