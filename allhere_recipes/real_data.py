"""The real-model job's text, in the model's own tokens: training windows drawn from inside documents and the
held-out windows every model is scored on.

A window never spans two documents: distant context within one file is what a global head can use, and a
window across a file boundary would only dilute it. Training draws a document with probability proportional
to its length, then a window of ``seq_len`` tokens at a uniform offset in it (a pure function of the step's
generator, so a resumed run sees the same batches); documents shorter than ``seq_len`` are left out. The
held-out windows are the first ``seq_len`` tokens of the validation documents, the longest first, then
consecutive later windows of the same documents where there are too few documents.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from allhere.data.corpus import SEPARATOR, DataError, stdlib_corpus, text_corpus


@dataclass
class TokenData:
    train: list[torch.Tensor]  # training documents of at least seq_len tokens, int64
    heldout: torch.Tensor  # [k, seq_len] int64
    heldout_docs: list[torch.Tensor]  # the validation documents in tokens (the long-prompt source)
    description: str
    fingerprint: str  # sha256 of the training and held-out tokens

    def batches(self, batch_size: int, seq_len: int):
        """A ``BatchFn`` for ``allhere.train.train``: ``batch_size`` windows of ``seq_len`` tokens."""
        lengths = torch.tensor([len(d) for d in self.train], dtype=torch.float64)

        def draw(step: int, micro: int, g: torch.Generator) -> torch.Tensor:
            docs = torch.multinomial(lengths, batch_size, replacement=True, generator=g).tolist()
            rows = []
            for i in docs:
                doc = self.train[i]
                start = int(torch.randint(0, len(doc) - seq_len + 1, (1,), generator=g))
                rows.append(doc[start:start + seq_len])
            return torch.stack(rows)

        return draw


def _texts(stream: torch.Tensor) -> list[str]:
    return [d.decode("utf-8", errors="replace") for d in bytes(stream.numpy()).split(SEPARATOR) if d]


def _encode(tokenizer, texts: list[str]) -> list[torch.Tensor]:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [torch.tensor(x, dtype=torch.int64) for x in ids]


def token_data(tokenizer, seq_len: int, eval_sequences: int, data_path: str | None = None) -> TokenData:
    """The stdlib corpus (or the user's text at ``data_path``) in the tokenizer's tokens."""
    corpus = stdlib_corpus() if data_path is None else text_corpus(data_path)
    train = [d for d in _encode(tokenizer, _texts(corpus.train)) if len(d) >= seq_len]
    val = sorted(_encode(tokenizer, [v.numpy().tobytes().decode("utf-8", errors="replace")
                                     for v in corpus.val_docs]), key=len, reverse=True)
    if not train:
        raise DataError(f"{corpus.source}: no training document has {seq_len} tokens")
    windows = [d[k * seq_len:(k + 1) * seq_len] for k in range(max(len(d) // seq_len for d in val))
               for d in val if len(d) >= (k + 1) * seq_len][:eval_sequences]
    if len(windows) < eval_sequences:
        raise DataError(f"{corpus.source}: the held-out text has {len(windows)} windows of {seq_len} tokens, "
                        f"{eval_sequences} are wanted")
    heldout = torch.stack(windows)
    sha = hashlib.sha256()
    for t in (*train, heldout):
        sha.update(t.numpy().tobytes())
    tokens = sum(len(d) for d in train)
    return TokenData(train, heldout, val, f"{corpus.source}: {len(train):,} training documents of >= {seq_len} "
                     f"tokens ({tokens:,} tokens); {len(heldout)} held-out windows of {seq_len} tokens from "
                     f"{len(val)} validation documents", sha.hexdigest())
