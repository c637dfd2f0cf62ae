"""The pretrained bases shipped with allhere: the demo's starting points.

The AHA paper ("Learning When Not to Attend Globally") does not pretrain: it takes a pretrained model and
fine-tunes AHA onto it. The demo does the same. For every task of the default ``cpu`` preset the package
holds the full-attention model that the preset's own pretraining produces (same settings, same seed), as
``bases/cpu-<task>.safetensors`` (bf16 weights, an allhere checkpoint without optimizer state, so
``allhere.runtime.model_checkpoint.load_model`` reads it) and ``bases/cpu-<task>.json``, its provenance: the command and
commit that made it, the data and its fingerprint, Python and torch versions, the model and training
configs, and the held-out numbers of the saved file. ``scripts/make_demo_bases.py`` makes them.

A base is used only as it was made: a missing or damaged file, a provenance that is missing or unreadable,
or a model config other than the preset's is refused with one line naming the file (``ConfigError``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from allhere.data.recall_task import RecallTask
from allhere.model import Decoder
from allhere.runtime.model_checkpoint import atomic_write, read_checkpoint, save_checkpoint
from allhere.validation import ConfigError

from .plans import TaskPlan
from .rundir import SETTINGS, read_settings

BASES = Path(__file__).parent / "bases"
PRESET = "cpu"  # the only preset with shipped bases
AGAIN = "reinstall allhere, or pass --pretrain to pretrain the base in this run"
RECALL_EVAL_SEED = 12345  # the held-out recall sequences (the seed ``evaluate_recall`` draws from)


def base_files(task: str, folder: Path | None = None) -> tuple[Path, Path]:
    """The weights and the provenance of the shipped base of ``task`` (in ``folder``, default ``BASES``)."""
    folder = BASES if folder is None else Path(folder)
    return folder / f"{PRESET}-{task}.safetensors", folder / f"{PRESET}-{task}.json"


@dataclass
class Base:
    """A shipped base, checked and loaded."""

    path: Path  # the weights
    provenance: dict
    model: Decoder  # fp32, on the CPU

    @property
    def record(self) -> dict:
        """What a run folder's settings.json records of it (the same for every copy of the same file)."""
        p = self.provenance
        return {"file": self.path.name, "sha256": p["sha256"], "steps": p["steps"], "commit": p["commit"]}


def describe(record: dict | None, steps: int | None = None) -> str:
    """"shipped base <file>, pretrained <steps> steps by allhere <commit>" or "pretrained in this run"."""
    if record is None:
        return "pretrained in this run" + (f" ({steps} steps)" if steps else "")
    return f"shipped base {record['file']}, pretrained {record['steps']} steps by allhere {record['commit'][:7]}"


def why_not_shipped(preset: str, data_path: str | None, plan: TaskPlan, default_plan: TaskPlan) -> str | None:
    """Why the demo pretrains ``plan``'s base itself instead of starting from the shipped one (None: it
    starts from the shipped one). Only the ``cpu`` preset on the stdlib corpus with the preset's
    pretraining has one; fine-tuning settings (window, lambda, steps, --compile) do not matter."""
    if preset != PRESET:
        return f"no shipped base for --preset {preset}"
    if data_path is not None:
        return "--data: a base of your own text"
    if dataclasses.replace(plan.pretrain, compile=False) != dataclasses.replace(default_plan.pretrain, compile=False):
        return f"--pretrain-steps {plan.pretrain.steps}: the shipped base has {default_plan.pretrain.steps}"
    return None


def load_base(task: str, plan: TaskPlan, folder: Path | None = None) -> Base:
    """The shipped base of ``task``, checked against its provenance and ``plan``'s model config."""
    path, prov_path = base_files(task, folder)
    prov = read_provenance(prov_path)
    if prov["model_config"] != plan.model.to_dict():
        diff = sorted(k for k, v in plan.model.to_dict().items() if prov["model_config"].get(k) != v)
        raise ConfigError(f"shipped base {path} was made for another model ({', '.join(diff)} differ from the "
                          f"preset's); {AGAIN}")
    if not path.is_file():
        raise ConfigError(f"shipped base {path} is missing; {AGAIN}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != prov["sha256"]:
        raise ConfigError(f"shipped base {path} is damaged ({len(data):,} bytes whose sha256 is not the one its "
                          f"provenance records: truncated or altered); {AGAIN}")
    model = Decoder(plan.model)
    restore(model, path)
    return Base(path, prov, model.eval())


PROVENANCE_KEYS = ("sha256", "steps", "commit", "model_config", "heldout", "data")


def read_provenance(path: Path) -> dict:
    """A base's provenance json (ConfigError, one line, when missing, unreadable or incomplete)."""
    if not path.is_file():
        raise ConfigError(f"the provenance of the shipped base, {path}, is missing; {AGAIN}")
    try:
        prov = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"the provenance of the shipped base, {path}, is unreadable ({e}); {AGAIN}") from None
    missing = [k for k in PROVENANCE_KEYS if not isinstance(prov, dict) or k not in prov]
    if missing:
        raise ConfigError(f"the provenance of the shipped base, {path}, lacks {', '.join(missing)}; {AGAIN}")
    return prov


def restore(model: Decoder, path: Path) -> None:
    """Load a base's weights into ``model`` (cast to its dtype); ConfigError, one line, when they do not fit."""
    try:
        tensors, _ = read_checkpoint(path)
    except ValueError as e:
        raise ConfigError(f"shipped base {path} does not load ({_first_line(e)}); {AGAIN}") from None
    tensors = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    want = model.state_dict()
    problems = [f"{k} missing" for k in want if k not in tensors]
    problems += [f"{k} unexpected" for k in tensors if k not in want]
    problems += [f"{k} is {list(tensors[k].shape)}, the model's {list(v.shape)}" for k, v in want.items()
                 if k in tensors and tensors[k].shape != v.shape]
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise ConfigError(f"shipped base {path} does not fit the preset's model ({problems[0]}{more}); {AGAIN}")
    model.load_state_dict(tensors)


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def save_base(path: Path, model: Decoder, state: dict, dtype: torch.dtype) -> None:
    """``model`` in ``dtype`` as an allhere checkpoint without optimizer state (tied weights stored once),
    written atomically; only the safetensors file (the provenance is written apart)."""
    low = copy.deepcopy(model).to(dtype)  # .to keeps tied parameters tied
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / path.name, low, None, state)
        atomic_write(path, lambda dest: shutil.copyfile(Path(tmp) / path.name, dest))


@torch.no_grad()
def heldout(task: str, plan: TaskPlan, data, model: Decoder) -> dict:
    """The held-out numbers a provenance records and the tests recompute: stdlib, the loss on the plan's
    ``eval_sequences`` validation windows; recall, the accuracy of the demo's evaluation and the loss on
    the answers (the tokens the recall task trains on) of ``eval_sequences`` held-out sequences, which
    tells two models apart where the accuracy does not."""
    r = data.evaluate(model)
    out = {"sequences": plan.eval_sequences, "seq_len": plan.seq_len}
    if task == "recall":
        ids, retrieval = RecallTask(seq_len=plan.seq_len).batch(plan.eval_sequences,
                                                                torch.Generator().manual_seed(RECALL_EVAL_SEED))
        total, count = 0.0, 0
        for chunk, where in zip(ids.split(64), retrieval.split(64)):
            logits = model.eval()(chunk).logits[:, :-1]
            answer = where[:, :-1]
            total += F.cross_entropy(logits[answer].float(), chunk[:, 1:][answer], reduction="sum").item()
            count += int(answer.sum())
        out["accuracy"] = r["accuracy"]
        r = {"loss": total / count}
    out.update(loss=r["loss"], bits_per_token=r["loss"] / math.log(2))
    return out


def base_in_folder(ckpt: Path, record: dict, base: Base | None, task: str, plan: TaskPlan) -> tuple[Decoder, list]:
    """The full model of a run started from the shipped base ``record``, and its pretraining curve: the
    run folder's copy at ``ckpt`` (fp32, no optimizer state), written from ``base`` (else from the shipped
    file, when it is the one ``record`` names) the first time."""
    from allhere.runtime.model_checkpoint import load_model

    if ckpt.exists():
        model, meta = load_model(ckpt)
        if meta.get("base") != record:
            raise ConfigError(f"{ckpt} is not the {describe(record)} its run started from; move the run folder "
                              "away or choose another --out (nothing was changed)")
        return model.eval(), meta.get("evals", [])
    if base is None:
        base = load_base(task, plan)
        if base.record != record:
            raise ConfigError(f"{ckpt.parent.parent} started from the {describe(record)}, which this allhere does "
                              f"not ship ({base.path.name} is another file); "
                              "choose another --out (nothing was changed)")
    evals = base.provenance.get("pretrain_evals", [])
    save_checkpoint(ckpt, base.model, None, {"step": record["steps"], "history": [], "evals": evals,
                                             "train_config": base.provenance.get("train_config"), "base": record})
    return copy.deepcopy(base.model), evals


FOLLOW = "follow"  # start_task's default base: the one the folder's run started from (a new one: pretrain)
NEW = object()  # folder_base of a folder that holds no run


def folder_base(run: Path):
    """The base the run in ``run`` started from: a shipped base's record, None (pretrained there), or NEW."""
    if not (Path(run) / SETTINGS).exists():
        return NEW
    return read_settings(run).get("base")


def choose_base(run: Path, task: str, preset: str, data_path: str | None, plan: TaskPlan, default_plan: TaskPlan,
                pretrain: bool) -> tuple["Base | str | None", str]:
    """What ``allhere demo`` starts ``task`` in the folder ``run`` from (``start_task``'s ``base``), and the
    line that says so. A folder that holds a run goes on from its own base (refused with ``pretrain``
    when that is a shipped one); a new one starts from the shipped base where there is one, unless
    ``pretrain``."""
    saved = folder_base(run)
    steps = plan.pretrain.steps
    if saved is not NEW:
        if pretrain and saved is not None:
            raise ConfigError(f"{run} holds a run that started from the {describe(saved)}; run the demo without "
                              "--pretrain to continue it, or choose another --out (nothing was changed)")
        return FOLLOW, f"{task}: base {describe(saved, steps)}, continued in {run}"
    reason = "--pretrain" if pretrain else why_not_shipped(preset, data_path, plan, default_plan)
    if reason:
        return None, f"{task}: base pretrained in this run ({steps} steps; {reason})"
    base = load_base(task, plan)
    return base, f"{task}: starting from the {describe(base.record)} (--pretrain trains it here instead)"
