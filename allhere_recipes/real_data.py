"""The real-model job's text, in the model's own tokens: training windows drawn from inside documents and the
held-out windows every model is scored on.

A window never spans two documents: distant context within one file is what a global head can use, and a
window across a file boundary would only dilute it. Training draws a document with probability proportional
to its length, then a window of ``seq_len`` tokens at a uniform offset in it (a pure function of the step's
generator, so a resumed run sees the same batches); documents shorter than ``seq_len`` are left out. The
held-out windows are the first ``seq_len`` tokens of the validation documents, the longest first, then
consecutive later windows of the same documents where there are too few documents.

Planted recall (``recall_share`` of the training windows): the code of the window with a five-digit number
stated early and asked for at its end, more than ``min_distance`` tokens later, in one of four forms (``FORMS``):
a constant and its assert, or a comment stating a fact and a comment asking for it. Predicting the number at the
end needs its statement, beyond any window of that size: in code that is otherwise mostly local, the training
signal that tells a router when a head must read far back. The passkey test (``allhere.eval.passkey``) has other
words and no code around it. The held-out windows stay unplanted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from allhere.data.corpus import SEPARATOR, DataError, stdlib_corpus, text_corpus

NAMES = ("RETRY_LIMIT", "MAX_DEPTH", "DEFAULT_PORT", "BUFFER_SIZE", "MAGIC_NUMBER", "CACHE_TTL", "BATCH_SEED",
         "PAGE_OFFSET", "TIMEOUT_MS", "BLOCK_COUNT", "USER_ID", "CHECKSUM")
FORMS = (  # (statement, question ending in the number): {name} a constant's name, {n} the number
    ("{name} = {n}\n", "assert {name} == {n}\n"),
    ("# Note: the secret number is {n}. Keep it in mind.\n", "# Q: what was the secret number? A: {n}\n"),
    ("# The vault combination is {n}.\n", "# The vault combination, from above: {n}\n"),
    ("# Ticket {n} tracks this module.\n", "# tracked in ticket {n}\n"),
)


@dataclass
class Planted:
    """Pre-tokenized recall pairs: a definition line and the check that repeats its number."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    min_distance: int  # tokens from the definition's end to the check's start, at least

    def into(self, doc: torch.Tensor, seq_len: int, g: torch.Generator) -> torch.Tensor:
        """A window of ``doc``'s code, ``seq_len`` tokens, with a pair planted: the check at its end."""
        define, check = self.pairs[int(torch.randint(0, len(self.pairs), (1,), generator=g))]
        code = seq_len - len(define) - len(check)
        at = int(torch.randint(0, code - self.min_distance + 1, (1,), generator=g))  # code before the definition
        start = int(torch.randint(0, len(doc) - code + 1, (1,), generator=g))
        piece = doc[start:start + code]
        return torch.cat([piece[:at], define, piece[at:], check])


def planted_pairs(tokenizer, count: int = 256, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        name = NAMES[int(torch.randint(0, len(NAMES), (1,), generator=g))]
        number = int(torch.randint(10000, 100000, (1,), generator=g))
        form = FORMS[int(torch.randint(0, len(FORMS), (1,), generator=g))]
        define, check = _encode(tokenizer, [f.format(name=name, n=number) for f in form])
        pairs.append((define, check))
    return pairs


@dataclass
class TokenData:
    train: list[torch.Tensor]  # training documents of at least seq_len tokens, int64
    heldout: torch.Tensor  # [k, seq_len] int64
    heldout_docs: list[torch.Tensor]  # the validation documents in tokens (the long-prompt source)
    description: str
    fingerprint: str  # sha256 of the training and held-out tokens
    planted: Planted | None = None

    def batches(self, batch_size: int, seq_len: int, recall_share: float = 0.0):
        """A ``BatchFn`` for ``allhere.train.train``: ``batch_size`` windows of ``seq_len`` tokens, each with a
        planted recall pair with probability ``recall_share``."""
        lengths = torch.tensor([len(d) for d in self.train], dtype=torch.float64)

        def draw(step: int, micro: int, g: torch.Generator) -> torch.Tensor:
            docs = torch.multinomial(lengths, batch_size, replacement=True, generator=g).tolist()
            rows = []
            for i in docs:
                doc = self.train[i]
                if recall_share and float(torch.rand((), generator=g)) < recall_share:
                    rows.append(self.planted.into(doc, seq_len, g))
                    continue
                start = int(torch.randint(0, len(doc) - seq_len + 1, (1,), generator=g))
                rows.append(doc[start:start + seq_len])
            return torch.stack(rows)

        return draw


def _texts(stream: torch.Tensor) -> list[str]:
    return [d.decode("utf-8", errors="replace") for d in bytes(stream.numpy()).split(SEPARATOR) if d]


def _encode(tokenizer, texts: list[str]) -> list[torch.Tensor]:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [torch.tensor(x, dtype=torch.int64) for x in ids]


def token_data(tokenizer, seq_len: int, eval_sequences: int, data_path: str | None = None,
               recall_distance: int = 0) -> TokenData:
    """The stdlib corpus (or the user's text at ``data_path``) in the tokenizer's tokens; with ``recall_distance``
    the recall pairs to plant (``Planted``) at least that far apart."""
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
    planted = None
    if recall_distance:
        pairs = [(a, b) for a, b in planted_pairs(tokenizer) if len(a) + len(b) + recall_distance <= seq_len]
        if not pairs:
            raise DataError(f"no recall pair fits {seq_len} tokens with {recall_distance} tokens between its parts")
        planted = Planted(pairs, recall_distance)
    return TokenData(train, heldout, val, f"{corpus.source}: {len(train):,} training documents of >= {seq_len} "
                     f"tokens ({tokens:,} tokens); {len(heldout)} held-out windows of {seq_len} tokens from "
                     f"{len(val)} validation documents", sha.hexdigest(), planted)
