"""Perplexity over long documents with rolling windows, so that no token is dropped.

Each document is read in windows of ``seq_len`` tokens that advance by ``stride``: the first window
scores all its tokens, every later window scores only the tokens no earlier window scored, each with at
least ``seq_len - stride`` tokens of context. Documents are scored separately (no context crosses a
document boundary). ``min_len`` skips documents shorter than it (the AHA paper drops samples shorter than
the window, so that the window is really in force).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..model import Decoder
from ..runtime.progress import progress as progress_bar
from ..validation import ConfigError


def rolling_windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target position) of each window over a document of n tokens."""
    if seq_len < 2:
        raise ConfigError(f"seq_len = {seq_len}: a window needs at least 2 tokens (one to predict the next from)")
    if not 1 <= stride <= seq_len:
        raise ConfigError(f"stride must be in [1, seq_len = {seq_len}], got {stride}")
    spans, start, first = [], 0, 1  # position 0 has no prediction
    while first < n:
        end = min(start + seq_len, n)
        spans.append((start, end, first))
        first = end
        start = max(0, min(end - 1, end + stride - seq_len))  # keep seq_len - stride tokens of context
    return spans


@torch.no_grad()
def rolling_perplexity(model: Decoder, docs: list[torch.Tensor], seq_len: int, stride: int | None = None,
                       min_len: int = 0, device: str = "cpu", progress: bool = False) -> dict:
    """Mean next-token loss (nats), perplexity, bits per token and mu_f over every scored token.
    ``progress``: report the documents done (``allhere.runtime.progress``)."""
    stride = stride or seq_len // 2
    model.eval().to(device)
    total, count, gates, gate_tokens, skipped = 0.0, 0, 0.0, 0, 0
    bar = progress_bar(len(docs), "perplexity (documents)", enabled=progress)
    for doc in docs:
        bar.update()
        if len(doc) < max(2, min_len):
            skipped += 1
            continue
        ids_all = doc.long().to(device)
        for start, end, first in rolling_windows(len(doc), seq_len, stride):
            ids = ids_all[start:end][None]
            out = model(ids)
            logits = out.logits[0, first - start - 1: end - start - 1].float()
            total += F.cross_entropy(logits, ids_all[first:end], reduction="sum").item()
            count += end - first
            if out.routing is not None:
                gates += out.routing.mu_f().item() * (end - start)
                gate_tokens += end - start
    bar.close()
    if count == 0:
        raise ConfigError(f"no document is at least {max(2, min_len)} tokens long (min_len = {min_len})")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_token": loss / math.log(2), "tokens": count,
            "skipped_docs": skipped, "mu_f": gates / gate_tokens if gate_tokens else None}


def hf_perplexity(model_path, byte_docs: list[torch.Tensor], seq_len: int, stride: int | None = None,
                  min_len: int = 0, device: str = "cpu", progress: bool = False) -> dict:
    """``rolling_perplexity`` of a Hugging Face model folder (plain, or saved converted to AHA / DAR) on
    documents given as UTF-8 bytes, tokenized with the model's own tokenizer; losses are per model token.
    A converted model also gets ``global_share`` (``allhere.hf.global_share`` at the measured mu_f)."""
    from ..hf import HFCausalLM, global_share
    from ..hf.io import load_local
    from ..mechanisms.base import mechanism_layers

    tokenizer, model = load_local(model_path)
    texts = [bytes(d.to(torch.uint8).tolist()).decode("utf-8", errors="replace") for d in byte_docs]
    docs = [torch.tensor(tokenizer(t)["input_ids"], dtype=torch.long) for t in texts]
    res = rolling_perplexity(HFCausalLM(model), docs, seq_len, stride, min_len, device, progress)
    if mechanism_layers(model) and (res["mu_f"] is not None or not any(m.routed for m in mechanism_layers(model))):
        res["global_share"] = global_share(model, res["mu_f"])
    return res
