"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and the export to one safetensors
file.

Beside the run's ``checkpoint.safetensors`` sits ``checkpoint.dcp/``: one folder per saved step
(``step-00000020/``, each rank writing its own shards of the model and optimizer plus its RNG state)
and ``latest.json`` (the training state: step, history, settings), which rank 0 replaces atomically
only after every rank has finished writing. A process killed while saving leaves a step folder that
``latest.json`` does not name, so resuming always starts from a complete checkpoint; older step
folders are removed after the switch. Data order needs no saved state: every micro-batch is a pure
function of (seed, step, micro-batch index).

Resuming on another number of ranks works (DCP reshards); the RNG states are then left as they are.
The export gathers the full model on rank 0 and writes our ordinary checkpoint format
(``allhere.runtime.model_checkpoint.save_checkpoint``, so ``allhere.runtime.model_checkpoint.load_model``
reads it), model only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.model_checkpoint import CheckpointError, atomic_write, save_checkpoint
from .env import DistEnv


def dcp_dir(ckpt_path: Path) -> Path:
    return Path(ckpt_path).with_suffix(".dcp")


def latest(ckpt_path: Path) -> dict | None:
    """The state saved with the newest complete sharded checkpoint, or None."""
    f = dcp_dir(ckpt_path) / "latest.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f} is corrupt ({e})") from e


def _rng(env: DistEnv) -> dict[str, torch.Tensor]:
    out = {f"cpu.{env.rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"cuda.{env.rank}"] = torch.cuda.get_rng_state()
    return out


def save(ckpt_path: Path, model, optimizer, state: dict, env: DistEnv) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = dcp_dir(ckpt_path)
    name = f"step-{state['step']:08d}"
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd, "rng": _rng(env)}, checkpoint_id=str(root / name))
    dist.barrier()
    if env.main:
        meta = dict(state, folder=name, world=env.world)
        atomic_write(root / "latest.json",
                     lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n"))
        for old in root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load(ckpt_path: Path, model, optimizer, env: DistEnv) -> dict:
    """Restore model, optimizer (and RNG, on the same number of ranks); return the saved state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = latest(ckpt_path)
    if meta is None:
        raise CheckpointError(f"no complete sharded checkpoint in {dcp_dir(ckpt_path)}")
    msd, osd = get_state_dict(model, optimizer)
    same_world = meta.get("world") == env.world
    sd = {"model": msd, "optim": osd, **({"rng": _rng(env)} if same_world else {})}
    try:
        dcp.load(sd, checkpoint_id=str(dcp_dir(ckpt_path) / meta["folder"]))
    except Exception as e:  # DCP raises several types for missing or mismatched shards
        raise CheckpointError(f"sharded checkpoint {dcp_dir(ckpt_path)} does not fit the model ({e})") from e
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if same_world:
        torch.set_rng_state(sd["rng"][f"cpu.{env.rank}"])
        if f"cuda.{env.rank}" in sd["rng"]:
            torch.cuda.set_rng_state(sd["rng"][f"cuda.{env.rank}"])
    return {k: v for k, v in meta.items() if k not in ("folder", "world")}


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, on rank 0 (empty elsewhere). Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class _Gathered:
    """What ``save_checkpoint`` reads of a model (``state_dict()`` and ``cfg``), from a gathered state."""

    def __init__(self, sd: dict, cfg) -> None:
        self._sd, self.cfg = sd, cfg

    def state_dict(self) -> dict:
        return self._sd


def export(ckpt_path: Path, model, state: dict, env: DistEnv) -> None:
    """Write the whole model to ``ckpt_path`` (rank 0), in the single-process checkpoint format."""
    sd = full_state_dict(model)
    if env.main:
        save_checkpoint(ckpt_path, _Gathered(sd, model.cfg), None,
                        dict(state, sharded_checkpoint=str(dcp_dir(ckpt_path).name)))
    dist.barrier()
