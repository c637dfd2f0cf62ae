"""The weight files of a model folder written by transformers' ``save_pretrained`` (safetensors)."""

from __future__ import annotations

import json
from pathlib import Path, PurePath

from ..runtime.model_checkpoint import CheckpointError

INDEX = "model.safetensors.index.json"


def weight_map(path: Path) -> dict[str, Path] | None:
    """Tensor name -> weight file, as the index of folder ``path`` names them; None without an index.
    CheckpointError in one line naming the index when it is not one (not JSON, no ``weight_map`` object of
    strings) or names a file outside the folder (an absolute path, or one through ``..``). The check is on the
    names as written: a file in the folder may be a symbolic link (the Hugging Face cache's are)."""
    index = path / INDEX
    if not index.exists():
        return None
    try:
        found = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    if not isinstance(found, dict) or not all(isinstance(f, str) and f for f in found.values()):
        raise CheckpointError(f"{index} is not a safetensors index (its weight_map is not an object of file names)")
    for f in found.values():
        if PurePath(f).is_absolute() or ".." in PurePath(f).parts:
            raise CheckpointError(f"{index} names a weight file outside its folder ({f[:200]!r}); refused")
    return {k: path / f for k, f in found.items()}


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model saved in folder ``path``: those its index names, or the one file."""
    index = weight_map(path)
    if index is not None:
        return sorted(set(index.values()))
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path} has no model.safetensors (or index): save with safe serialization")
    return [single]
