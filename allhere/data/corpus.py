"""Byte-level text corpora that need no download.

The embedded default is the source of the running interpreter's standard library (found with
``sysconfig``): every ``*.py`` file under it, sorted by relative path, split into train/validation by
file with a hash of the path (deterministic on any machine with the same Python version). Users pass
their own text files (a file or a folder of ``.txt``/``.py``/``.md`` files) or a ``datasets`` dataset
saved with ``save_to_disk`` that has a ``text`` column.

Tokenizer: raw UTF-8 bytes (vocabulary 256), so the loss in bits per token is bits per byte.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
SEPARATOR = b"\n\x00\n"  # between documents
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".json", ".jsonl", ".csv")


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class DataError(ValueError):
    """A data path is missing, empty or unreadable. The message names it."""


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 token stream
    val: torch.Tensor
    source: str  # where it came from, for reports
    val_docs: list[torch.Tensor] | None = None  # the validation documents one by one (for perplexity)

    def describe(self) -> str:
        return f"{self.source}: {len(self.train):,} train bytes, {len(self.val):,} validation bytes"


def _split(docs: list[tuple[str, bytes]], val_percent: int, source: str) -> Corpus:
    train, val = [], []
    for name, text in docs:
        bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
        (val if bucket < val_percent else train).append(text)
    if not train or not val:
        raise DataError(f"{source}: need files for both train and validation, got {len(train)} and {len(val)} "
                        f"(pass more than one file, or a larger folder)")
    # An empty file (Python 3.12's standard library has some in its validation share) is no document to score.
    return Corpus(_bytes_tensor(SEPARATOR.join(train)), _bytes_tensor(SEPARATOR.join(val)), source,
                  [_bytes_tensor(v) for v in val if v])


def stdlib_corpus(val_percent: int = 5) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise DataError(f"no Python files found under the standard library at {root}")
    docs = [(str(p.relative_to(root)), p.read_bytes()) for p in files]
    return _split(docs, val_percent, f"Python {sysconfig.get_python_version()} standard library ({root})")


def text_corpus(path: str | Path, val_percent: int = 5) -> Corpus:
    """A UTF-8 text file (split into train/validation by line blocks), a folder of text files, or a
    ``datasets`` dataset on disk (folder with ``dataset_info.json`` or ``dataset_dict.json``)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path {p} does not exist")
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        return _datasets_corpus(p, val_percent)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        docs = [(str(f.relative_to(p)), text_bytes(f)) for f in files]
        docs = [(n, t) for n, t in docs if t.strip()]
        if not docs:
            raise DataError(f"data folder {p} holds no non-empty text files ({', '.join(TEXT_SUFFIXES)})")
        if len(docs) == 1:
            return _split_single(docs[0][1], val_percent, str(p))
        return _split(docs, val_percent, str(p))
    text = text_bytes(p)
    if not text.strip():
        raise DataError(f"data file {p} is empty")
    return _split_single(text, val_percent, str(p))


def text_bytes(path: Path) -> bytes:
    """The bytes of a text file; DataError for anything else (a binary file, another encoding): the
    models read raw bytes and would train on it without complaint."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text (byte {e.start} is not valid UTF-8); convert it to "
                        "UTF-8 or pass a text file") from None
    if b"\x00" in data:
        raise DataError(f"data file {path} is not text (it holds NUL bytes at {data.index(0)})")
    return data


def _split_single(text: bytes, val_percent: int, source: str) -> Corpus:
    """One document: the last val_percent of it (at a line break) is validation."""
    cut = int(len(text) * (100 - val_percent) / 100)
    cut = text.rfind(b"\n", 0, cut) + 1 or cut
    if cut <= 0 or cut >= len(text):
        raise DataError(f"{source} is too short to split into train and validation")
    val = _bytes_tensor(text[cut:])
    return Corpus(_bytes_tensor(text[:cut]), val, source, [val])


def _datasets_corpus(p: Path, val_percent: int) -> Corpus:
    try:
        import datasets
    except ImportError as e:
        raise DataError("loading a saved dataset needs the 'datasets' package: pip install 'allhere[data]'") from e
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        train_name = "train" if "train" in ds else names[0]
        val_name = next((n for n in ("validation", "valid", "test") if n in ds), None)
        splits = {"train": ds[train_name], "val": ds[val_name] if val_name else None}
    else:
        splits = {"train": ds, "val": None}
    if "text" not in splits["train"].column_names:
        raise DataError(f"dataset {p} has no 'text' column (columns: {splits['train'].column_names})")
    if splits["val"] is None:
        docs = [(str(i), t.encode()) for i, t in enumerate(splits["train"]["text"]) if t]
        return _split(docs, val_percent, str(p))
    join = lambda col: SEPARATOR.join(t.encode() for t in col if t)  # noqa: E731
    train, val = join(splits["train"]["text"]), join(splits["val"]["text"])
    if not train or not val:
        raise DataError(f"dataset {p} has an empty train or validation split")
    val_docs = [_bytes_tensor(t.encode()) for t in splits["val"]["text"] if t]
    return Corpus(_bytes_tensor(train), _bytes_tensor(val), str(p), val_docs)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq_len`` tokens from a token stream: [batch, seq_len] int64."""
    if len(stream) < seq_len:
        raise DataError(f"token stream of {len(stream)} tokens is shorter than seq_len={seq_len}")
    starts = torch.randint(0, len(stream) - seq_len + 1, (batch,), generator=generator)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows from the start of a stream: [k, seq_len] int64."""
    k = min(max_windows, len(stream) // seq_len)
    if k == 0:
        raise DataError(f"validation stream of {len(stream)} tokens is shorter than seq_len={seq_len}")
    return stream[: k * seq_len].view(k, seq_len).long()

