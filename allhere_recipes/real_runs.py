"""The pieces every real-model job shares: its run folder, the model it starts from, fine-tuning runs that end
as model folders, results kept per stage, and the whole job's time left.

A job's folder is ``<out>/<job>`` (``aha`` or ``dar``): settings.json (the plan, the model, the data's
fingerprint: a folder holding other settings is refused), ``results/<stage>.json`` for every evaluation done
(a rerun skips it), and one folder per fine-tuning run: ``checkpoint.safetensors`` while it trains (resumed
after Ctrl-C), then ``model/``, a transformers folder in bfloat16 (the dtype SmolLM2 is published in) that
``allhere generate --model`` and ``allhere.hf.load_pretrained`` load; the checkpoint, with its optimizer
state (four times the model), is removed once ``model/`` is written; ``tensorboard/`` (its training curves,
where reported) and, beside every saved model, ``card.json`` (what its card was first written with). Every
evaluation reads the fine-tuned models as saved: their weights rounded to bfloat16, computed in float32 on the CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch

from allhere.config import TrainConfig
from allhere.hf import HFCausalLM, convert
from allhere.hf.io import load_local
from allhere.train import train

from .job import Job
from .real_data import TokenData, token_data
from .rundir import claim, write_json

SAVED_DTYPE = torch.bfloat16
MADE_BY = "allhere demo --model (the real-model job)"  # what a saved model's card says wrote it
CARD_RECORD = "card.json"  # beside a converted model's folder: its card's source, settings and results
DECODE_TOKENS = 16  # a decode step's cost in forward tokens, for the time estimate (CPU, a 135M model)


def resolve_model(name_or_path: str, progress: bool = True, log=print) -> Path:
    """A model folder or GGUF file as given, or the cached file of a known model, fetched first when it is not in
    the cache (``allhere.runtime.models_cache.fetch``: what ``allhere fetch`` does, its progress shown). ConfigError
    in one line saying what to do when it cannot be fetched (no network, say)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    from allhere.runtime import models_cache
    from allhere.validation import ConfigError

    if name_or_path not in models_cache.KNOWN:
        raise ConfigError(f"{name_or_path}: no such model file or folder, nor the name of a known model "
                          f"({', '.join(sorted(models_cache.KNOWN))})")
    try:
        return models_cache.model_path(name_or_path)
    except ConfigError:  # not fetched yet
        pass
    log(f"{name_or_path} is not in allhere's cache ({models_cache.cache_dir()}): fetching it once, as "
        f"`allhere fetch {name_or_path}` does")
    return models_cache.fetch(name_or_path, progress=progress)


def load_and_claim(task: Path, job: str, source: Path, plan, device: str, data_path: str | None, log,
                   recall_distance: int = 0) -> tuple[object, object, TokenData]:
    """(tokenizer, the pretrained model in float32 on ``device``, its ``token_data``) of a job, with ``task``
    claimed for the job's settings (the plan, the model, the data's fingerprint) and the data logged."""
    tokenizer, base = load_local(source, convertible=True, dtype=torch.float32)
    base.to(device)
    data = token_data(tokenizer, plan.seq_len, plan.eval_sequences, data_path, recall_distance)
    # a saved plan read back through the plan's dataclass: a field added since is at its default, not a difference
    claim(task, {"job": job, "model": str(Path(source).resolve()), "plan": plan.to_dict(),
                 "data_path": data_path, "data_sha256": data.fingerprint},
          upgrade=lambda saved: {**saved, "plan": type(plan)(**saved["plan"]).to_dict()})
    log(f"{source}: {data.description}")
    return tokenizer, base, data


def stage(task: Path, name: str, run: Callable[[], dict]) -> dict:
    """``run()``'s result, kept in ``task/results/<name>.json``: computed once, read back on a rerun."""
    path = task / "results" / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = run()
    write_json(path, result)
    return result


def token_cost(model, tokens: int, seq_len: int) -> float:
    """A forward's multiply-adds over ``tokens`` tokens in sequences of ``seq_len``: 2 per weight per token and
    causal attention's (the unit of ``allhere_recipes.job``; a training step costs about 3 forwards)."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return tokens * (2.0 * params + 2.0 * c.num_hidden_layers * seq_len * c.hidden_size)


def plan_run(job: Job, folder: Path, cfg: TrainConfig, model, seq_len: int) -> None:
    """A fine-tuning run in the job's estimate (nothing left once its model folder exists)."""
    ckpt = folder / "checkpoint.safetensors"
    cost = 3.0 * token_cost(model, cfg.batch_size * cfg.grad_accum * seq_len, seq_len)
    job.plan(ckpt, 0 if (folder / "model" / "config.json").exists() else cfg.steps, cost)


def plan_work(job: Job, task: Path, name: str, units: int, cost: float) -> None:
    """An evaluation stage in the job's estimate: ``units`` items of ``cost`` each (none once it is done)."""
    job.plan_named(f"{task.name}/{name}", 0 if (task / "results" / f"{name}.json").exists() else units, cost)


def work_bar(job: Job, task: Path, name: str, units: int):
    return job.bar(units, f"{task.name}/{name}")


def fine_tune(folder: Path, base, mechanism, cfg: TrainConfig, batches, tokenizer, job: Job,
              train_only: str | None = None, start=None, calibration: torch.Tensor | None = None):
    """``base`` (or ``start``, a model already converted) fine-tuned with ``cfg``: a copy converted to
    ``mechanism`` (None: left plain; ``calibration``: token ids for a mechanism initialised from the host,
    ``allhere.hf.convert``), trained in ``folder`` (resumed from its checkpoint) and saved as ``folder/model``;
    a finished run is read back from there. Returns the model in float32, with the saved weights."""
    saved = folder / "model"
    if (saved / "config.json").exists():
        return load_local(saved, dtype=torch.float32)[1]
    if start is not None:
        model = copy.deepcopy(start)
    else:
        model = copy.deepcopy(base)
        if mechanism is not None:
            convert(model, mechanism, seed=0, calibration=calibration)
    ckpt = folder / "checkpoint.safetensors"
    state = train(HFCausalLM(model), batches, cfg, ckpt, resume=True, progress=job.bar, train_only=train_only)
    write_json(folder / "history.json", state["history"], indent=None)  # loss, mu_f, lambda per step
    from allhere.hf.card import training_results
    from allhere.routing import routed_layers

    card = {"source": base.config.name_or_path, "settings": {"steps": cfg.steps, "lr": cfg.lr, "lambda": cfg.lam,
                                                             "target_mu_f": cfg.target_mu_f},
            "results": training_results(state, routed=bool(routed_layers(model)))}
    save_model(model, saved, tokenizer, card)
    for done in (ckpt, ckpt.with_suffix(".json")):
        done.unlink(missing_ok=True)
    return model.float()


def save_model(model, folder: Path, tokenizer, card: dict | None = None) -> None:
    """``model`` in bfloat16 with its tokenizer as a transformers folder, written whole or not at all; the model
    keeps the rounded weights. Its README.md (``allhere.hf.card.write_card``, a plain control's too; ``card``: its
    ``source``, ``settings`` and ``results``) has its inputs kept beside the folder first (``CARD_RECORD``: the
    job writes the card again with its held-out numbers, ``real_heldout.write_cards``)."""
    from allhere.hf import converted_mechanism, save_pretrained
    from allhere.hf.card import write_card
    from allhere.runtime.atomic_folder import write_folder

    model.to(SAVED_DTYPE)
    card = dict(card or {})
    write_json(folder.parent / CARD_RECORD, {**card, "source": None if card.get("source") is None else
                                             str(card["source"]),
                                             "results": [dataclasses.asdict(r) for r in card.get("results", ())]})
    with write_folder(folder) as tmp:  # a temporary sibling, fsynced, renamed (the job holds its run lock)
        if converted_mechanism(model) is not None:
            save_pretrained(model, tmp)
        else:  # a plain model (a control): transformers' own save
            model.save_pretrained(str(tmp))
        write_card(tmp, model.config, MADE_BY, shown_as=folder, **card)
        tokenizer.save_pretrained(str(tmp))


def train_config(plan, steps: int, lr: float, lam: float = 0.0, target_mu_f: float | None = None,
                 router_lr_mult: float = 1.0) -> TrainConfig:
    """The paper's optimizer (AdamW, betas 0.9 / 0.95, warmup 3%, no weight decay as ``allhere sft``), a
    checkpoint every 25 steps (a checkpoint of a 135M model with its optimizer state is 1.6 GB)."""
    return TrainConfig(steps=steps, batch_size=plan.batch_size, grad_accum=plan.grad_accum, lr=lr, beta1=0.9,
                       beta2=0.95, warmup_ratio=0.03, weight_decay=0.0, lam=lam, target_mu_f=target_mu_f,
                       lam_rate=plan.lam_rate, router_lr_mult=router_lr_mult, ckpt_every=25, log_every=1,
                       device=plan.device, seed=plan.seed)

