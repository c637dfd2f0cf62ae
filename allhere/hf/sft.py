"""Supervised fine-tuning of a converted Hugging Face model on chat data (seeds/003 section 3.1).

Defaults are the paper's: AdamW lr 3e-5, betas (0.9, 0.95), warmup ratio 0.03, global batch 128 (by
gradient accumulation), lambda 3e-4, tau 0.5, one epoch. The loss counts assistant tokens only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from ..config import AHAConfig, ConfigError, TrainConfig
from ..data.chat import ensure_chat_template, load_chat, pack, tokenize_conversation
from ..model import DecoderOutput
from ..train import train
from .convert import _mechanisms, collect_routing, convert
from .io import save_pretrained


class _ConfigView:
    def __init__(self, config) -> None:
        self.config = config

    def to_dict(self) -> dict:
        return {"transformers_config": json.loads(self.config.to_json_string())}


class HFCausalLM(nn.Module):
    """Gives a converted transformers model the interface of ``allhere.Decoder`` that the training loop uses."""

    def __init__(self, model) -> None:
        super().__init__()
        self.hf = model
        self.cfg = _ConfigView(model.config)

    def forward(self, input_ids: torch.Tensor) -> DecoderOutput:
        out = self.hf(input_ids=input_ids, use_cache=False)
        converted = getattr(self.hf.config, "allhere_aha", None) is not None
        return DecoderOutput(out.logits, collect_routing(self.hf) if converted else None, None)

    def aha_modules(self):
        if getattr(self.hf.config, "allhere_aha", None) is None:
            return []  # a plain model (e.g. the SDPA baseline of a benchmark)
        return list(enumerate(_mechanisms(self.hf)))


def load_local(model_path: str | Path):
    """Tokenizer and model from a local folder, with transformers' own loaders (never the network)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(model_path)
    if not (p / "config.json").exists():
        raise ConfigError(f"model path {p} is not a saved transformers model (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, attn_implementation="sdpa")
    return tokenizer, model


def sft(model_path: str | Path, data_path: str | Path, out: str | Path, window: int, seq_len: int = 2048,
        batch_size: int = 4, global_batch: int = 128, epochs: float = 1.0, lr: float = 3e-5, lam: float = 3e-4,
        tau: float = 0.5, max_steps: int | None = None, device: str = "cpu", resume: bool = False, seed: int = 0,
        progress: bool = True) -> dict:
    """Convert the model at ``model_path`` to AHA and fine-tune it on the chat data; the result is saved
    to ``out/model`` (``allhere.hf.load_pretrained`` reads it back). Returns the training state."""
    if global_batch % batch_size:
        raise ConfigError(f"global_batch = {global_batch} must be a multiple of batch_size = {batch_size}")
    out = Path(out)
    tokenizer, model = load_local(model_path)
    context = getattr(model.config, "max_position_embeddings", seq_len)
    if seq_len > context:
        raise ConfigError(f"seq_len = {seq_len} is longer than the model's context ({context})")
    used_fallback = ensure_chat_template(tokenizer)
    rows = load_chat(data_path)
    ids, mask = pack([tokenize_conversation(tokenizer, r["messages"]) for r in rows], seq_len)
    convert(model, AHAConfig(window=window, tau=tau, lam=lam))
    accum = global_batch // batch_size
    n = ids.shape[0]
    steps = max_steps or max(1, math.ceil(epochs * n / global_batch))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))

    def batches(step: int, micro: int, g: torch.Generator):
        first = (step * accum + micro) * batch_size
        idx = order[(first + torch.arange(batch_size)) % n]
        return ids[idx], mask[idx]

    cfg = TrainConfig(steps=steps, batch_size=batch_size, grad_accum=accum, lr=lr, beta1=0.9, beta2=0.95,
                      warmup_ratio=0.03, weight_decay=0.0, lam=lam, ckpt_every=max(1, min(100, steps)),
                      log_every=1, seed=seed, device=device)
    state = train(HFCausalLM(model), batches, cfg, out / "checkpoint.safetensors", resume=resume,
                  progress=progress, extra_state={"chat_template_fallback": used_fallback, "sequences": n})
    save_pretrained(model, out / "model")
    tokenizer.save_pretrained(str(out / "model"))
    return state
