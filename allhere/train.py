"""The training loop, for pretraining and fine-tuning alike: L = L_LM + lambda * L_reg (AHA paper, Eq. 6).

Reads top to bottom: set up the optimizer, resume if asked, then for every step draw the step's
micro-batches (a pure function of the seed and the step, so a resumed run sees the same data), forward,
backward, clip, step (and, with ``target_mu_f``, move lambda towards the share of full attention asked
for), log, evaluate, checkpoint; the log steps and evaluations also go to TensorBoard where asked
(``allhere.runtime.reporting``). The checkpoint's folder is locked for the run (``allhere.runtime.runlock``); Ctrl-C
or SIGTERM finishes the step in flight, checkpoints and raises ``allhere.runtime.interrupt.Interrupted``.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Callable

import torch

from .config import TrainConfig
from .distributed.context import check_supported as check_context_parallel
from .distributed.context import shard_loss
from .distributed.parallel import ParallelConfig
from .distributed.training import distributed_run
from .losses import training_loss
from .mechanisms.base import mechanism_layers
from .model import Decoder
from .routing import routed_layers
from .runtime.interrupt import Interrupted, stop_signals
from .runtime.model_checkpoint import (
    CheckpointError,
    read_checkpoint,
    restore_model,
    restore_optimizer,
    save_checkpoint,
)
from .runtime.progress import progress as progress_bar
from .runtime.reporting import open_report
from .runtime.runlock import run_lock
from .validation import ConfigError

# (step, micro-batch index, a generator seeded by both) -> token ids [batch, seq], or (ids, loss_mask), or
# (ids, loss_mask, segment_starts): loss_mask [batch, seq] (or None) marks the target tokens that count in
# the loss; segment_starts [batch, seq] (``allhere.masks.starts_from``) keeps packed documents and padding
# apart (passed to the model as ``segment_starts``).
BatchFn = Callable[[int, int, torch.Generator], "torch.Tensor | tuple[torch.Tensor, ...]"]
EvalFn = Callable[[Decoder], dict]


def step_generator(seed: int, step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + micro)


def unpack_batch(batch, device):
    """(ids, loss mask or None, keyword arguments of the model call) of what a ``BatchFn`` returned."""
    ids, mask, starts = (*batch, None, None)[:3] if isinstance(batch, tuple) else (batch, None, None)
    kwargs = {} if starts is None else {"segment_starts": starts.to(device)}
    return ids.to(device), None if mask is None else mask.to(device), kwargs


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine decay to lr * min_lr_ratio."""
    warm = int(cfg.warmup_ratio * cfg.steps)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with three groups: matrices with weight decay; norms, biases and embeddings without; the
    mechanisms' router parameters without weight decay at lr * router_lr_mult."""
    routers = {id(p) for m in mechanism_layers(model) for p in m.router_parameters()}
    groups = {"decay": [], "no_decay": [], "router": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in routers:
            groups["router"].append(p)
        elif p.dim() >= 2 and "embed" not in name:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    params = [
        {"params": groups["decay"], "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
        {"params": groups["no_decay"], "weight_decay": 0.0, "lr_mult": 1.0},
        {"params": groups["router"], "weight_decay": 0.0, "lr_mult": cfg.router_lr_mult},
    ]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def model_lam(model: torch.nn.Module, cfg: TrainConfig) -> float:
    """lambda of L_reg: the training config's, else the one the routed layers' configs agree on, else 0."""
    if cfg.lam is not None:
        return cfg.lam
    lams = {m.cfg.lam for _, m in routed_layers(model) if hasattr(m.cfg, "lam")}
    if len(lams) > 1:
        raise ValueError(f"routed layers disagree on lam ({sorted(lams)}); set TrainConfig.lam")
    return lams.pop() if lams else 0.0


LAM_RANGE = (1e-6, 10.0)  # where a lambda trained towards ``target_mu_f`` is kept


def adapt_lam(lam: float, mu_f: float, cfg: TrainConfig) -> float:
    """One dual-ascent step on log lambda towards ``cfg.target_mu_f``: up when the step's mu_f is above the
    target, down when below, by the relative error (so a target of 1% and one of 30% adapt alike)."""
    lam *= math.exp(cfg.lam_rate * min(max((mu_f - cfg.target_mu_f) / cfg.target_mu_f, -1.0), 1.0))
    return min(max(lam, LAM_RANGE[0]), LAM_RANGE[1])


def train(model: Decoder, batches: BatchFn, cfg: TrainConfig, ckpt_path: str | Path, resume: bool = False,
          eval_fn: EvalFn | None = None, progress: "bool | Callable" = True, extra_state: dict | None = None,
          train_only: str | None = None, parallel: ParallelConfig | None = None, report_to: str | None = None) -> dict:
    """Train ``model`` in place; checkpoint to ``ckpt_path``; return the final state (history, metrics).

    ``model``: our ``Decoder`` or anything with its call interface (``allhere.hf.HFCausalLM``).
    ``resume=True`` continues from ``ckpt_path`` exactly where it stopped; without it an existing
    checkpoint there is an error (nothing good is overwritten). ``train_only``: train only the parameters
    whose name contains it (e.g. ".mechanism." for a new bottleneck); the others stay frozen.
    ``progress``: a bar (True), none (False), or a factory with ``allhere.runtime.progress.progress``'s signature
    that makes the bar (``allhere_recipes.job``: one that also tells the whole job's time left).
    ``report_to``: "tensorboard" (event files in the checkpoint's folder, ``allhere.runtime.reporting``) or "none";
    None (default): the innermost ``allhere.runtime.reporting.report_to`` block's choice, else none. An evaluation's
    ``usage`` (mu_f per layer and head, as ``allhere.eval.evaluate_lm`` gives it) goes to the report as an
    image, not into the state's ``evals``.

    Under torchrun with several processes (``allhere.distributed.training``) the model is sharded with
    FSDP2, each rank takes its share of every step's micro-batches (same global batch, same gradient),
    checkpoints are sharded (``ckpt_path`` with suffix ``.dcp``) and the final model is exported to
    ``ckpt_path``; only rank 0 writes files and shows progress. With one process nothing of this runs.
    ``parallel`` (``allhere.distributed.ParallelConfig``, default: data parallel over every process): the
    ranks form its dp x cp mesh; each micro-batch goes to one data-parallel replica, whose cp ranks split
    each sequence with its layout, attention running through the ring (``allhere.distributed.context``:
    every mechanism that declares a ring plan; packed documents, no padding). The gradient and the logged
    losses are the one-process ones. With cp > 1 the model is checked before anything starts, then the
    mesh against the processes and ``cfg.grad_accum``.

    No other process may write ``ckpt_path``'s folder meanwhile (``allhere.runtime.runlock.RunLocked``). SIGINT
    (Ctrl-C) or SIGTERM during the loop: the step in flight is finished and checkpointed, then
    ``Interrupted`` is raised (``resume=True`` continues from there); a second signal stops at once.
    Under torchrun every rank stops after the same step.
    """
    ckpt_path = Path(ckpt_path)
    with run_lock(ckpt_path.parent):
        return _train(model, batches, cfg, ckpt_path, resume, eval_fn, progress, extra_state, train_only,
                      parallel or ParallelConfig(), report_to)


def _train(model, batches, cfg, ckpt_path, resume, eval_fn, progress, extra_state, train_only, parallel, report_to):
    if parallel.context_parallel > 1:  # every layer must run through the ring: said before anything starts
        check_context_parallel(model)
    run = distributed_run(cfg.device, parallel, cfg.grad_accum)  # None with one process
    cp = None if run is None or run.cp == 1 else run.layout  # the layout of context-parallel training, or None
    device = cfg.device if run is None else run.device
    model.to(device)
    for name, p in model.named_parameters():  # stage-wise training (e.g. only a new bottleneck first)
        p.requires_grad_(train_only is None or train_only in name)
    if run is not None:
        run.shard(model)
    opt = make_optimizer(model, cfg)
    lam = model_lam(model, cfg)
    state = {"step": 0, "history": [], "evals": [], "train_config": cfg.to_dict(), **(extra_state or {})}
    if cfg.target_mu_f is not None:  # lambda is trained too: it lives in the state (and checkpoints)
        if not routed_layers(model):
            raise ConfigError(f"target_mu_f = {cfg.target_mu_f} needs a model with routed layers (AHA): nothing "
                              "else has a share of full attention to steer")
        state["lam"] = lam = max(lam, LAM_RANGE[0])
    if train_only is not None:
        state["train_only"] = train_only
    found = ckpt_path.exists() if run is None else run.has_checkpoint(ckpt_path)
    if found:
        if not resume:
            raise CheckpointError(f"{ckpt_path} already exists: pass --resume to continue it, or choose another "
                                  "output directory")
        if run is None:
            tensors, meta = read_checkpoint(ckpt_path)
            check_settings(meta, cfg, train_only, ckpt_path, state.get("data_sha256"))
            restore_model(model, tensors, ckpt_path)
            restore_optimizer(opt, tensors, meta, ckpt_path)
            model.to(device)
        else:
            check_settings(run.saved_state(ckpt_path) or {}, cfg, train_only, ckpt_path, state.get("data_sha256"))
            meta = run.restore(ckpt_path, model, opt)
        state.update({k: meta[k] for k in ("step", "history", "evals", "lam") if k in meta})
        lam = state.get("lam", lam)

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
                else contextlib.nullcontext())
    bar = (progress if callable(progress) else progress_bar)(
        cfg.steps, f"{ckpt_path.parent.parent.name}/{ckpt_path.parent.name}", state["step"],
        bool(progress) and (run is None or run.main))
    save = save_checkpoint if run is None else run.save
    forward = torch.compile(model) if cfg.compile and run is None else model  # shares the model's parameters
    model.train()
    report = open_report(report_to, ckpt_path, state["step"], cfg.steps, run is None or run.main)
    with stop_signals() as stop, report:  # Ctrl-C / SIGTERM: finish the step, checkpoint, stop
        for step in range(state["step"], cfg.steps):
            began, tokens = time.perf_counter(), 0
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step) * group["lr_mult"]
            # loss, lm and mu_f summed on the device in float64 (as Python floats would be), read once a step: no
            # host-device sync per micro-batch
            acc = torch.zeros(3, dtype=torch.float64, device=device)
            # this rank's share of the step's micro-batches
            micros = range(cfg.grad_accum) if run is None else run.micro_batches()
            share = cfg.grad_accum * (run.cp if cp else 1)  # context parallel: every cp rank logs 1/cp
            for micro in micros:
                batch = batches(step, micro, step_generator(cfg.seed, step, micro))
                ids, loss_mask, kwargs = unpack_batch(batch, device)
                tokens += ids.numel()
                if cp:  # this rank's shard of every sequence
                    loss = shard_loss(model, ids, lam, cp, loss_mask, autocast, run.cp_group, **kwargs)
                else:
                    with autocast:
                        out = forward(ids, **kwargs)
                    pads = kwargs["segment_starts"] < 0 if "segment_starts" in kwargs else None  # not in L_reg, mu_f
                    loss = training_loss(out, ids, lam, None if pads is None else ~pads, loss_mask)
                (loss.total / len(micros)).backward()
                mu_f = torch.ones((), device=device) if loss.mu_f is None else loss.mu_f
                acc += torch.stack([t.detach().double() for t in (loss.total, loss.lm, mu_f)]) / share
            sums = dict(zip(("loss", "lm", "mu_f"), acc.tolist()))
            if run is not None:
                sums = run.sum(sums)
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            report.step(tokens * cfg.grad_accum / len(micros), time.perf_counter() - began)  # the whole step's tokens
            logged = {k: round(v, 5) for k, v in sums.items()}
            if cfg.target_mu_f is not None:  # every rank saw the same summed mu_f: the same lambda everywhere
                logged["lam"] = float(f"{lam:.4g}")  # the lambda this step trained with
                state["lam"] = lam = adapt_lam(lam, sums["mu_f"], cfg)
            state["step"] = step + 1
            bar.update(1)
            bar.set_postfix(lm=f"{sums['lm']:.3f}", mu_f=f"{sums['mu_f']:.3f}")
            if state["step"] % cfg.log_every == 0 or state["step"] == cfg.steps:
                state["history"].append({"step": state["step"], **logged})
                report.log(state["step"], sums, logged.get("lam", lam), lr_at(cfg, step))
            if eval_fn is not None and cfg.eval_every and state["step"] % cfg.eval_every == 0:
                result = eval_fn(model)
                report.evaluation(state["step"], result, model)
                state["evals"].append({"step": state["step"], **{k: v for k, v in result.items() if k != "usage"}})
                model.train()
            # a signal received by any rank stops every rank after this same step
            signum = stop.signum if run is None else run.agree(stop.signum)
            if state["step"] % cfg.ckpt_every == 0 or state["step"] == cfg.steps or signum:
                save(ckpt_path, model, opt, state)
                report.flush()  # the events of every step the checkpoint holds
            if signum:
                bar.close()
                raise Interrupted(signum, state["step"], cfg.steps, ckpt_path)
    bar.close()
    if run is not None:  # the whole model in one safetensors file, as one process writes it
        run.export(ckpt_path, model, state)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return state


def check_settings(meta: dict, cfg: TrainConfig, train_only: str | None, ckpt_path: Path,
                   data_sha256: str | None = None) -> None:
    """A checkpoint is resumed only with the settings it was written with (read back through
    ``TrainConfig``: a field added since, at its default, is no difference) and, where the caller names its data
    by a fingerprint (``extra_state["data_sha256"]``), on the same data."""
    if data_sha256 is not None and meta.get("data_sha256") not in (None, data_sha256):
        raise CheckpointError(f"{ckpt_path} was trained on other data (sha256 {meta['data_sha256'][:12]}..., "
                              f"now {data_sha256[:12]}...); resume with the same data or choose another output "
                              "directory")
    try:
        saved = TrainConfig(**meta["train_config"]).to_dict()
    except (KeyError, TypeError, ValueError):  # no settings, fields this version does not know, bad values
        saved = None
    if saved != cfg.to_dict() or meta.get("train_only") != train_only:
        raise CheckpointError(f"{ckpt_path} was written with other training settings; resume with the "
                              "same settings or choose another output directory")
