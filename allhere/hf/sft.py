"""Supervised fine-tuning of a converted Hugging Face model on chat data (section 3.1 of the AHA paper,
"Learning When Not to Attend Globally"; section 3 of the DAR paper, arXiv:2606.18587, for DAR's two stages).

Defaults are the papers': AdamW lr 3e-5, betas (0.9, 0.95), warmup ratio 0.03, global batch 128 (by
gradient accumulation), lambda 3e-4, tau 0.5, one epoch; DAR's stage 1 at lr 3e-4. The loss counts
assistant tokens only.

Precision: the weights are trained in float32 whatever dtype the checkpoint was published in (an AdamW
update of lr 3e-5 is below bf16's resolution for most weights, and float16 training overflows), with
bf16 autocast on CUDA; the checkpoints for resuming hold float32, the final ``out/model`` is cast back to
the published dtype (config.json ``torch_dtype``), so it is as large as the model it came from. A GGUF file's
is saved in float32, which holds its de-quantized weights exactly (larger than the file's quantized blocks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from pathlib import Path

import torch

from ..config import TrainConfig
from ..data.chat import ensure_chat_template, load_chat, pack, tokenize_conversation
from ..distributed.env import detect
from ..distributed.parallel import ParallelConfig
from ..distributed.sharded_checkpoint import full_state_dict
from ..mechanisms import AHAConfig, DARConfig
from ..runtime.atomic_folder import write_folder
from ..runtime.reporting import stale_events
from ..runtime.runlock import run_lock
from ..train import train
from ..validation import ConfigError
from .causal_lm import HFCausalLM
from .convert import convert, converted_mechanism
from .io import check_causal_lm, load_local, save_pretrained, saved_dtype, saved_mechanism


def _trained_mechanism(saved, mech):
    """The mechanism config a run trains: ``mech`` for a plain model; for a model that comes converted (saved
    by allhere, or the AHA authors' checkpoint) its ``saved`` one with lambda as asked, if it is the mechanism
    asked for with the same window, threshold and sinks (ConfigError otherwise)."""
    if saved is None:
        return mech
    same = type(saved) is type(mech) and all(getattr(saved, f) == getattr(mech, f)
                                             for f in ("window", "tau", "sinks", "d_down") if hasattr(mech, f))
    if not same:
        raise ConfigError(f"the model is already converted to {saved}; fine-tune it with the same mechanism, window, "
                          "threshold and sinks, or start from the plain model")
    return dataclasses.replace(saved, lam=mech.lam) if hasattr(saved, "lam") else saved


def _load(model_path, config, mech, layers, seed: int, env, device: str):
    """(tokenizer, converted model in float32, the mechanism trained, the device). One process: the whole model,
    converted with its mechanism weights drawn from ``seed``. Under torchrun: straight into FSDP2 shards
    (``allhere.hf.sharded_load``: no rank holds the whole model), with the same weights."""
    saved = saved_mechanism(config)
    trained = _trained_mechanism(saved, mech)
    if env is None:
        tokenizer, model = load_local(model_path, convertible=True, dtype=torch.float32, layers=layers)  # fp32 master
        if converted_mechanism(model) is None:
            convert(model, mech, layers=layers, seed=seed)
        return tokenizer, model, trained, device
    from ..distributed.env import init
    from .sharded_load import load_sharded

    device = init(env, device)
    tokenizer, model = load_sharded(model_path, mechanism=None if saved is not None else mech, layers=layers,
                                    dtype=torch.float32, device=device, seed=seed, measure_memory=True)
    return tokenizer, model, trained, device


def _load_report(model) -> dict:
    """Every rank's peak resident memory while loading (``LoadReport``), gathered: what the run's state keeps."""
    import torch.distributed as dist

    report = model.allhere_load_report
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, report.peak_rss_delta_bytes)
    return {"peak_rss_delta_bytes": peaks, "full_model_bytes": report.full_model_bytes,
            "measured_by": report.peak_source}


def _card(folder: Path, model, model_path, data_path, state: dict, cfg: TrainConfig, sequences: int, seq_len: int,
          d_down, stage1_lr: float, shown_as: Path) -> None:
    """The saved model's README.md (``allhere.hf.card``) in ``folder`` (written before it becomes ``shown_as``): the
    run's settings and the numbers its training logged."""
    from ..routing import routed_layers
    from .card import training_results, write_card

    settings = {"data": Path(data_path).name, "sequences": sequences, "seq_len": seq_len,
                "global_batch": cfg.batch_size * cfg.grad_accum, "lr": cfg.lr,
                "stage1_lr": stage1_lr if d_down is not None else None, "target_mu_f": cfg.target_mu_f,
                "stages": "2 (the bottleneck alone, then everything); the results are stage 2's" if d_down else None}
    write_card(folder, model.config, "allhere sft", source=model_path, settings=settings,
               results=training_results(state, routed=bool(routed_layers(model))), shown_as=shown_as)


def sft(model_path: str | Path, data_path: str | Path, out: str | Path, window: int, seq_len: int = 2048,
        batch_size: int = 4, global_batch: int = 128, epochs: float = 1.0, lr: float = 3e-5, lam: float = 3e-4,
        tau: float = 0.5, max_steps: int | None = None, device: str = "cpu", resume: bool = False, seed: int = 0,
        progress: bool = True, d_down: int | None = None, stage1_lr: float = 3e-4,
        target_mu_f: float | None = None, layers="full", context_parallel: int = 1, cp_layout: str = "zigzag",
        sinks: int = 0) -> dict:
    """Convert the model at ``model_path`` and fine-tune it on the chat data; the result is saved to
    ``out/model`` (``allhere.hf.load_pretrained`` reads it back). Returns the (last) training state.
    ``layers``: which layers get the mechanism, as ``allhere.hf.convert`` takes it (default: the
    full-attention ones).

    Without ``d_down``: AHA (``sinks``: its local branch also reads the first tokens, ``AHAConfig.sinks``), one
    run with L_LM + lam L_reg, checkpoint ``out/checkpoint.safetensors``;
    with ``target_mu_f`` lambda starts at ``lam`` and is trained towards that share of full attention
    (``TrainConfig.target_mu_f``).
    With ``d_down``: DAR in two stages of ``epochs`` each -- stage 1 trains only W_down / W_up
    at ``stage1_lr`` with the rest frozen (``out/stage1.safetensors``), stage 2 everything at ``lr``
    (``out/stage2.safetensors``).

    The conversion's new weights (routers, bottlenecks) are drawn from ``seed`` (``convert(..., seed=)``),
    as are the batches' order.

    Under torchrun with several processes (``torchrun --nproc-per-node N -m allhere.cli sft ...``) the model
    is loaded straight into FSDP2 shards (``allhere.hf.sharded_load``; every rank's peak memory at load is
    kept in the state as ``load``) and trained on a dp x cp mesh (``allhere.train.train``; an
    ``allhere.distributed.ParallelConfig``): ``context_parallel`` = cp ranks split each sequence
    (``cp_layout``), the ring running every layer's attention; the N / cp data-parallel replicas share each
    step's micro-batches, so ``global_batch / batch_size`` must be a multiple of N / cp. The losses and the
    gradient are the one-process ones. Rank 0 writes ``out/model``.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len = {seq_len}: a sequence needs at least 2 tokens (one to predict the next from)")
    if global_batch % batch_size:
        raise ConfigError(f"global_batch = {global_batch} must be a multiple of batch_size = {batch_size}")
    if target_mu_f is not None and d_down is not None:
        raise ConfigError("target_mu_f steers AHA's routers; DAR (d_down) has none")
    parallel = ParallelConfig(context_parallel=context_parallel, layout=cp_layout)
    env = detect()
    parallel.mesh(1 if env is None else env.world, global_batch // batch_size, seq_len)  # before loading anything
    if env is not None:
        from .sharded_load import refuse_gguf

        refuse_gguf(Path(model_path))
    out = Path(out)
    with run_lock(out):  # one writer per run folder; train() takes it again (reentrant)
        stale = None if resume or (env is not None and not env.main) else stale_events(out)
        if stale is not None:  # the events of a run killed before its first checkpoint: this run writes anew
            shutil.rmtree(stale)
        rows = load_chat(data_path)  # the data first: a bad file is reported before a model is loaded
        mech = (AHAConfig(window=window, tau=tau, lam=lam, sinks=sinks) if d_down is None
                else DARConfig(window=window, d_down=d_down))
        config = check_causal_lm(model_path, convertible=True, layers=layers, mechanism=mech)
        published = saved_dtype(config, model_path)
        tokenizer, model, mech, device = _load(model_path, config, mech, layers, seed, env, device)
        context = getattr(model.config, "max_position_embeddings", seq_len)
        if seq_len > context:
            raise ConfigError(f"seq_len = {seq_len} is longer than the model's context ({context})")
        used_fallback = ensure_chat_template(tokenizer)
        ids, mask, starts = pack([tokenize_conversation(tokenizer, r["messages"]) for r in rows], seq_len)
        accum = global_batch // batch_size
        n = ids.shape[0]
        steps = max_steps or max(1, math.ceil(epochs * n / global_batch))
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))

        def batches(step: int, micro: int, g: torch.Generator):
            first = (step * accum + micro) * batch_size
            idx = order[(first + torch.arange(batch_size)) % n]
            return ids[idx], mask[idx], starts[idx]

        cfg = TrainConfig(steps=steps, batch_size=batch_size, grad_accum=accum, lr=lr, beta1=0.9, beta2=0.95,
                          warmup_ratio=0.03, weight_decay=0.0, lam=lam if d_down is None else 0.0,
                          ckpt_every=max(1, min(100, steps)), log_every=1, seed=seed, device=device,
                          target_mu_f=target_mu_f)
        # the conversations' fingerprint: --resume on other data is refused (``allhere.train.check_settings``)
        data_sha256 = hashlib.sha256(json.dumps([r["messages"] for r in rows], sort_keys=True).encode()).hexdigest()
        extra = {"chat_template_fallback": used_fallback, "sequences": n, "data_sha256": data_sha256}
        if env is not None:
            extra["load"] = _load_report(model)
        lm = HFCausalLM(model)
        if d_down is None:
            state = train(lm, batches, cfg, out / "checkpoint.safetensors", resume=resume, progress=progress,
                          extra_state=extra, parallel=parallel)
        else:
            train(lm, batches, dataclasses.replace(cfg, lr=stage1_lr), out / "stage1.safetensors", resume=resume,
                  progress=progress, extra_state={**extra, "stage": 1}, train_only=".allhere.", parallel=parallel)
            state = train(lm, batches, cfg, out / "stage2.safetensors", resume=resume, progress=progress,
                          extra_state={**extra, "stage": 2}, parallel=parallel)
        if env is not None:  # under torchrun the model is sharded: rank 0 saves the gathered weights
            sd = full_state_dict(lm)
            if env.main:  # the model around the gathered weights, without a second copy
                from .sharded_load import assemble

                model = assemble(model_path, {k.removeprefix("hf."): v for k, v in sd.items()}, mech, layers)
            if not env.main:
                torch.distributed.barrier()
                return state
        # whole or not at all: a killed save leaves the checkpoint, from which --resume saves it again (replace: that
        # of a finished run, saved again by --resume)
        with write_folder(out / "model", replace=True) as partial:
            save_pretrained(model.to(published), partial)  # in the dtype the input model was published in
            tokenizer.save_pretrained(str(partial))
            _card(partial, model, model_path, data_path, state, cfg, n, seq_len, d_down, stage1_lr, out / "model")
        if env is not None:
            torch.distributed.barrier()
        return state
