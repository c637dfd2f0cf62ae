"""The weight files of a model folder written by transformers' ``save_pretrained`` (safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import CheckpointError


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model saved in folder ``path``: those its index names, or the one file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path} has no model.safetensors (or index): save with safe serialization")
    return [single]
