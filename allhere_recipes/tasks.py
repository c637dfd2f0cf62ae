"""The tasks of the experiments in a run directory: their data and evaluations (``TaskData``), the
pretrained full model (``start_task``), pretraining and fine-tuning, each resumed from its checkpoint.

Two tasks: "stdlib" (language modelling on the embedded stdlib corpus or the user's text) and "recall"
(the synthetic key-value recall task). A task's folder is ``<out>/<task>``: settings.json, the
pretrained model in pretrain/checkpoint.safetensors (pretrained there, or a copy of the shipped base the
run started from, ``allhere_recipes.bases``), every fine-tune in a folder of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from allhere.config import ModelConfig, TrainConfig
from allhere.data.corpus import eval_windows, sample_batch, stdlib_corpus, text_corpus
from allhere.data.recall_task import RecallTask
from allhere.eval import evaluate_lm, evaluate_recall
from allhere.model import Decoder, swap_mechanism
from allhere.train import train

from .bases import FOLLOW, NEW, Base, base_in_folder, folder_base
from .plans import TaskPlan, plan_from_dict, run_settings
from .rundir import check_out, claim


@dataclass
class TaskData:
    """A task's batches and evaluations, shared by every experiment."""

    description: str
    pretrain_batches: Callable
    finetune_batches: Callable
    evaluate: Callable[[Decoder], dict]  # held-out evaluation of a model
    periodic: Callable[[Decoder], dict]  # a cheaper one, during training
    metric: str  # the quality metric in evaluate's result
    higher_is_better: bool
    heldout: list  # held-out token batches [b, seq] (for routing statistics)
    docs: list  # held-out documents one by one (for rolling-window perplexity); empty for recall
    fingerprint: dict = field(default_factory=dict)  # sha256 of the data a base is trained and scored on


def task_data(name: str, plan: TaskPlan, data_path: str | None = None) -> TaskData:
    """The data of task ``name`` ("stdlib": ``data_path`` or the stdlib corpus; "recall") for ``plan``."""
    dev = plan.pretrain.device
    if name == "stdlib":
        corpus = stdlib_corpus() if data_path is None else text_corpus(data_path)
        batches = lambda step, micro, g: sample_batch(corpus.train, plan.pretrain.batch_size, plan.seq_len, g)  # noqa: E731
        windows = eval_windows(corpus.val, plan.seq_len, plan.eval_sequences)
        return TaskData(corpus.describe(), batches, batches, lambda m: evaluate_lm(m, windows, device=dev),
                        lambda m: _brief(evaluate_lm(m, windows[:16], device=dev), ("loss", "mu_f")),
                        "bits_per_token", False, list(windows.split(16)), corpus.val_docs,
                        {"train_sha256": _sha(corpus.train), "val_sha256": _sha(corpus.val),
                         "train_bytes": len(corpus.train), "val_bytes": len(corpus.val)})
    task = RecallTask(seq_len=plan.seq_len)
    probe = (task.batch(64, torch.Generator().manual_seed(12345))[0],  # the first held-out batch
             task.training_batch(plan.pretrain.batch_size, torch.Generator().manual_seed(0), curriculum=True)[0])
    return TaskData(
        f"recall task {dataclasses.asdict(task)} (min distance query->pair {task.min_distance} tokens)",
        lambda step, micro, g: task.training_batch(plan.pretrain.batch_size, g, curriculum=True),
        lambda step, micro, g: task.training_batch(plan.finetune.batch_size, g),
        lambda m: evaluate_recall(m, task, plan.eval_sequences, device=dev),
        lambda m: _brief(evaluate_recall(m, task, 128, device=dev, usage=True), ("accuracy", "mu_f")),
        "accuracy", True, list(task.batch(256, torch.Generator().manual_seed(99))[0].split(64)), [],
        {"task": dataclasses.asdict(task), "sequences_sha256": _sha(torch.cat([p.flatten() for p in probe]))})


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _brief(metrics: dict, keys: tuple[str, ...]) -> dict:
    """``keys`` of ``metrics``, rounded; and its mu_f per layer and head (``usage``) where it has one, for the
    training report's heatmap (``allhere.train.train`` keeps it out of the state)."""
    return {**{k: round(metrics[k], 5) for k in keys}, **({"usage": metrics["usage"]} if "usage" in metrics else {})}


@dataclass
class Task:
    """One task of a run directory, with its pretrained full-attention model."""

    name: str
    plan: TaskPlan
    run: Path  # the task's folder
    data: TaskData
    full: Decoder  # the pretrained full-attention model
    pretrain_curve: list  # its periodic evaluations
    base: dict | None = None  # the shipped base it is (``bases.Base.record``); None: pretrained in the folder


def start_task(out: str | Path, name: str, plan: TaskPlan, data_path: str | None, progress: bool,
               base: "Base | str | None" = FOLLOW, claimed: Callable[[], None] | None = None) -> Task:
    """Build the task's data, claim ``out/name`` for ``plan``, ``data_path`` and the base (refused when it
    holds other settings) and get its full model: ``base`` None, pretrained here (reused when finished,
    resumed when interrupted); a shipped ``Base``, copied into the folder as its pretrained model;
    ``FOLLOW``, whatever the folder's run started from (a new folder: pretrained here). ``claimed`` is
    called once the folder is claimed, before any training (a refusal before it leaves nothing said)."""
    check_out(out)
    run = Path(out) / name
    data = task_data(name, plan, data_path)  # the data first: a bad --data claims nothing
    saved = folder_base(run)
    shipped = None if base is None or isinstance(base, str) else base
    record = (None if saved is NEW else saved) if base == FOLLOW else None if shipped is None else shipped.record
    claim(run, run_settings(plan, data_path, record),
          upgrade=lambda old: run_settings(plan_from_dict(old["plan"]), old["data_path"], old.get("base")))
    if claimed:
        claimed()
    ckpt = run / "pretrain" / "checkpoint.safetensors"
    if record is None:
        full, curve = pretrain(ckpt, plan.model, plan, data, progress)
    else:
        full, curve = base_in_folder(ckpt, record, shipped, name, plan)
    return Task(name, plan, run, data, full, curve, record)


def pretrain(ckpt: Path, model: ModelConfig, plan: TaskPlan, data: TaskData, progress: bool) -> tuple[Decoder, list]:
    """A ``model`` trained from the plan's seed on the pretraining batches with the plan's pretraining
    settings (reused from ``ckpt`` when finished); and its periodic evaluations."""
    torch.manual_seed(plan.pretrain.seed)
    net = Decoder(model)
    evals = train(net, data.pretrain_batches, plan.pretrain, ckpt, resume=True, eval_fn=data.periodic,
                  progress=progress)["evals"]
    return net, evals


def finetune(task: Task, ckpt: Path, mechanism, progress: bool, base: Decoder | None = None,
             cfg: TrainConfig | None = None, train_only: str | None = None,
             periodic: bool = True) -> tuple[Decoder, list]:
    """A copy of ``base`` (default the task's pretrained model) with ``mechanism`` swapped in, trained on
    the fine-tuning batches with ``cfg`` (default the plan's fine-tuning), reused from ``ckpt`` when
    finished; and its periodic evaluations (none when ``periodic`` is False). ``train_only``: see
    ``allhere.train.train``."""
    model = swap_mechanism(task.full if base is None else base, mechanism)
    state = train(model, task.data.finetune_batches, cfg or task.plan.finetune, ckpt, resume=True,
                  eval_fn=task.data.periodic if periodic else None, progress=progress, train_only=train_only)
    return model, state["evals"]
