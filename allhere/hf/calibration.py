"""Calibration text for a conversion that is initialised from the host (``convert(..., calibration=ids)``), read
from a local text file: ``dar_latent`` chooses the rotary pairs it keeps per KV head by the host's own attention
on it (MHA2MLA's 2-norm choice, "Towards Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in
Any Transformer-based LLMs", arXiv:2502.14837)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.corpus import text_bytes
from ..validation import ConfigError

WINDOWS, LENGTH = 8, 512  # as allhere's SmolLM2 job calibrates: 8 windows of 512 tokens
SHORTEST = 16  # fewer tokens than this measure nothing worth choosing by
CHARS_PER_TOKEN = 16  # read at most this many characters per token wanted (more than any tokenizer's average)


def calibration_text(path: str, windows: int = WINDOWS, length: int = LENGTH) -> str:
    """The beginning of the text file ``path``: enough for ``windows`` windows of ``length`` tokens (a large corpus
    is not tokenized whole). Checked as ``--data`` files are (readable, UTF-8, no NUL bytes); read before the model
    is loaded, so that a bad file fails at once."""
    return text_bytes(Path(path)).decode("utf-8")[:windows * length * CHARS_PER_TOKEN]


def calibration_ids(tokenizer, text: str, windows: int = WINDOWS, length: int = LENGTH) -> torch.Tensor:
    """``text`` tokenized by ``tokenizer`` as token ids [b, n]: its first ``windows`` whole windows of ``length``
    tokens, or all of it as one window where it is shorter than one."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ids) < SHORTEST:
        raise ConfigError(f"--calibration: the text has {len(ids)} tokens; at least {SHORTEST} are needed")
    n = min(windows, len(ids) // length)
    return torch.tensor(ids[:n * length]).view(n, length) if n else torch.tensor(ids)[None]
