"""Supervised fine-tuning of a converted Hugging Face model on chat data (section 3.1 of the AHA paper,
"Learning When Not to Attend Globally"; section 3 of the DAR paper, arXiv:2606.18587, for DAR's two stages).

Defaults are the papers': AdamW lr 3e-5, betas (0.9, 0.95), warmup ratio 0.03, global batch 128 (by
gradient accumulation), lambda 3e-4, tau 0.5, one epoch; DAR's stage 1 at lr 3e-4. The loss counts
assistant tokens only.

Precision: the weights are trained in float32 whatever dtype the checkpoint was published in (an AdamW
update of lr 3e-5 is below bf16's resolution for most weights, and float16 training overflows), with
bf16 autocast on CUDA; the checkpoints for resuming hold float32, the final ``out/model`` is cast back to
the published dtype (config.json ``torch_dtype``), so it is as large as the model it came from.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from ..config import TrainConfig
from ..distributed.checkpoint import full_state_dict
from ..distributed.env import detect
from ..data.chat import ensure_chat_template, load_chat, pack, tokenize_conversation
from ..mechanisms import AHAConfig, DARConfig
from ..runlock import run_lock
from ..train import train
from ..validation import ConfigError
from .causal_lm import HFCausalLM
from .convert import convert, converted_mechanism
from .io import check_causal_lm, load_local, save_pretrained, saved_dtype


def _continue_or_convert(model, mech, layers):
    """Convert a plain model; a model that comes converted (saved by allhere, or the AHA authors' checkpoint)
    is fine-tuned as it is, if it is the mechanism asked for with the same window and threshold. Returns the
    mechanism config trained (the saved one, with lambda as asked)."""
    saved = converted_mechanism(model)
    if saved is None:
        convert(model, mech, layers=layers)
        return mech
    same = type(saved) is type(mech) and all(getattr(saved, f) == getattr(mech, f) for f in ("window", "tau", "d_down")
                                             if hasattr(mech, f))
    if not same:
        raise ConfigError(f"the model is already converted to {saved}; fine-tune it with the same mechanism, window "
                          "and threshold, or start from the plain model")
    return dataclasses.replace(saved, lam=mech.lam) if hasattr(saved, "lam") else saved


def sft(model_path: str | Path, data_path: str | Path, out: str | Path, window: int, seq_len: int = 2048,
        batch_size: int = 4, global_batch: int = 128, epochs: float = 1.0, lr: float = 3e-5, lam: float = 3e-4,
        tau: float = 0.5, max_steps: int | None = None, device: str = "cpu", resume: bool = False, seed: int = 0,
        progress: bool = True, d_down: int | None = None, stage1_lr: float = 3e-4,
        target_mu_f: float | None = None, layers="full") -> dict:
    """Convert the model at ``model_path`` and fine-tune it on the chat data; the result is saved to
    ``out/model`` (``allhere.hf.load_pretrained`` reads it back). Returns the (last) training state.
    ``layers``: which layers get the mechanism, as ``allhere.hf.convert`` takes it (default: the
    full-attention ones).

    Without ``d_down``: AHA, one run with L_LM + lam L_reg, checkpoint ``out/checkpoint.safetensors``;
    with ``target_mu_f`` lambda starts at ``lam`` and is trained towards that share of full attention
    (``TrainConfig.target_mu_f``).
    With ``d_down``: DAR in two stages of ``epochs`` each -- stage 1 trains only W_down / W_up
    at ``stage1_lr`` with the rest frozen (``out/stage1.safetensors``), stage 2 everything at ``lr``
    (``out/stage2.safetensors``).

    Under torchrun with several processes (``torchrun --nproc-per-node N -m allhere.cli sft ...``) the
    training is FSDP2 data-parallel (``allhere.train.train``); ``global_batch / batch_size`` must then be
    a multiple of N. Rank 0 writes ``out/model``.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len = {seq_len}: a sequence needs at least 2 tokens (one to predict the next from)")
    if global_batch % batch_size:
        raise ConfigError(f"global_batch = {global_batch} must be a multiple of batch_size = {batch_size}")
    if target_mu_f is not None and d_down is not None:
        raise ConfigError("target_mu_f steers AHA's routers; DAR (d_down) has none")
    out = Path(out)
    with run_lock(out):  # one writer per run folder; train() takes it again (reentrant)
        rows = load_chat(data_path)  # the data first: a bad file is reported before a model is loaded
        mech = AHAConfig(window=window, tau=tau, lam=lam) if d_down is None else DARConfig(window=window, d_down=d_down)
        published = saved_dtype(check_causal_lm(model_path, convertible=True, layers=layers, mechanism=mech),
                                model_path)
        tokenizer, model = load_local(model_path, convertible=True, dtype=torch.float32, layers=layers)  # fp32 master weights
        context = getattr(model.config, "max_position_embeddings", seq_len)
        if seq_len > context:
            raise ConfigError(f"seq_len = {seq_len} is longer than the model's context ({context})")
        used_fallback = ensure_chat_template(tokenizer)
        ids, mask, starts = pack([tokenize_conversation(tokenizer, r["messages"]) for r in rows], seq_len)
        mech = _continue_or_convert(model, mech, layers)
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
        extra = {"chat_template_fallback": used_fallback, "sequences": n}
        lm = HFCausalLM(model)
        if d_down is None:
            state = train(lm, batches, cfg, out / "checkpoint.safetensors", resume=resume, progress=progress,
                          extra_state=extra)
        else:
            train(lm, batches, dataclasses.replace(cfg, lr=stage1_lr), out / "stage1.safetensors", resume=resume,
                  progress=progress, extra_state={**extra, "stage": 1}, train_only=".allhere.")
            state = train(lm, batches, cfg, out / "stage2.safetensors", resume=resume, progress=progress,
                          extra_state={**extra, "stage": 2})
        env = detect()
        if env is not None:  # under torchrun the model is sharded: rank 0 saves the gathered weights
            sd = full_state_dict(lm)
            if env.main:
                _, model = load_local(model_path, convertible=True, dtype=torch.float32, layers=layers)
                _continue_or_convert(model, mech, layers)
                HFCausalLM(model).load_state_dict(sd)
            if not env.main:
                torch.distributed.barrier()
                return state
        save_pretrained(model.to(published), out / "model")  # in the dtype the input model was published in
        tokenizer.save_pretrained(str(out / "model"))
        if env is not None:
            torch.distributed.barrier()
        return state
