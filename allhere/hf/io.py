"""Save and load converted models: transformers' own safetensors files, the AHA settings in config.json.

``load_pretrained`` needs no ``trust_remote_code``: transformers loads the pretrained weights with its
own loader, allhere converts the model again and loads the router weights from the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import CheckpointError
from ..config import ConfigError, mechanism_from_dict
from .convert import convert


def save_pretrained(model, path: str | Path, **kwargs) -> None:
    """``model.save_pretrained`` (safetensors); the AHA settings travel in config.json as ``allhere_aha``."""
    if getattr(model.config, "allhere_aha", None) is None:
        raise ValueError("this model is not converted to AHA; save it with model.save_pretrained")
    model.save_pretrained(str(path), **kwargs)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path} has no model.safetensors (or index): save with safe serialization")
    return [single]


def load_pretrained(path: str | Path, **kwargs):
    """Load a model saved by ``save_pretrained``: the same weights, routers included. kwargs go to
    ``AutoModelForCausalLM.from_pretrained`` (dtype, device_map, ...)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} is not a saved model folder (no config.json)")
    config = AutoConfig.from_pretrained(str(path))
    settings = getattr(config, "allhere_aha", None)
    if settings is None:
        raise ConfigError(f"{path} holds no AHA settings ('allhere_aha' missing from config.json); load it with "
                          "transformers and convert it with allhere.hf.convert")
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the router weights are "unexpected" until convert() adds the routers
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    convert(model, mechanism_from_dict(settings))
    wanted = {k for k in model.state_dict() if ".aha." in k}
    routers: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as fh:
            routers.update({k: fh.get_tensor(k) for k in fh.keys() if k in wanted})
    missing = wanted - set(routers)
    if missing:
        raise CheckpointError(f"{path} lacks router weights {sorted(missing)[:3]}...")
    model.load_state_dict(routers, strict=False)
    return model
