"""GGUF files (llama.cpp's format) as ordinary transformers models.

transformers reads a GGUF itself (``from_pretrained(folder, gguf_file=...)``) and de-quantizes every tensor to
float32, which is exact: a quantized weight *is* the values its blocks de-quantize to. ``load`` then rebuilds the
result as an ordinary model, so every command and function that takes a model folder takes a GGUF file too, and
``save_pretrained`` writes it as an ordinary safetensors folder. The file is checked before any tensor is read:
a file that is not GGUF, a truncated one, an architecture transformers cannot de-quantize, a missing package --
each one line. Needs the ``gguf`` extra (the ``gguf`` and ``accelerate`` packages).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from .._optional import require
from ..runtime.model_checkpoint import CheckpointError
from ..validation import ConfigError

MAGIC = b"GGUF"  # a GGUF file's first four bytes
EXTRA = "gguf"
# architectures as a file may name them -> as transformers' table names them (its GGUF loader maps them so)
SPELLINGS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
             "t5encoder": "t5"}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that begins with the GGUF magic bytes."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


def require_packages() -> None:
    """ImportError naming the extra when ``gguf`` or ``accelerate`` is missing (transformers' GGUF loader needs
    both)."""
    for module in ("gguf", "accelerate"):
        require(module, EXTRA)


def supported_architectures() -> set[str]:
    """The GGUF ``general.architecture`` values transformers de-quantizes: the table of its GGUF loader and, where
    this transformers has one, that of its newer GGUF path."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # sections of the table, not architectures
    try:
        from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS
    except ImportError:  # transformers before the newer path
        return names
    return names | set(GGUF_ARCHS)


def _key(path: str | Path) -> tuple[str, int, int]:
    p = Path(path).resolve()
    st = p.stat()
    return str(p), st.st_size, st.st_mtime_ns


def check(path: str | Path) -> str:
    """The ``general.architecture`` of the GGUF file ``path``, after checking, before any tensor is de-quantized,
    that it is a whole GGUF of an architecture transformers de-quantizes: ConfigError (not GGUF, an architecture
    transformers does not know), CheckpointError (truncated or damaged), ImportError (a package missing)."""
    if not is_gguf(path):
        raise ConfigError(f"{path} is not a GGUF file (it does not begin with the bytes 'GGUF')")
    require_packages()
    return _check(*_key(path))


@functools.lru_cache(maxsize=8)
def _check(path: str, size: int, mtime_ns: int) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)  # the header and the tensor table; the data is only mapped
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except KeyError:
        raise CheckpointError(f"{path} names no general.architecture: it holds no model") from None
    except (ValueError, IndexError, struct.error, UnicodeDecodeError, OSError) as e:  # numpy's words for a short file
        raise CheckpointError(f"{path} is truncated or damaged: its header and tensor table cannot be read "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    if end > size:
        raise CheckpointError(f"{path} is truncated: its tensors end at byte {end:,}, the file has {size:,} bytes")
    known = supported_architectures()
    if arch not in known and SPELLINGS.get(arch) not in known:
        raise ConfigError(f"{path} holds a GGUF of architecture {arch!r}, which transformers cannot de-quantize "
                          f"(it can: {', '.join(sorted(known))})")
    return arch


def read_config(path: str | Path):
    """The transformers config of the GGUF file ``path`` (checked first, as ``check``)."""
    check(path)
    return copy.deepcopy(_config(*_key(path)))  # a copy: callers may change theirs


@functools.lru_cache(maxsize=8)
def _config(path: str, size: int, mtime_ns: int):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(Path(path).parent), gguf_file=path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as e:
        raise ConfigError(f"{path}: transformers cannot read its config ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]})") from None


def load_tokenizer(path: str | Path):
    """The tokenizer (chat template included) the GGUF file ``path`` carries, through transformers' own converter."""
    from transformers import AutoTokenizer

    check(path)
    p = Path(path).resolve()
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} has no tokenizer transformers can build ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]})") from None


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if dtype == "auto":  # the weights are float32 once de-quantized (exactly)
        return torch.float32
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"dtype must be a torch dtype, its name or 'auto', got {dtype!r}")
    return value


@contextlib.contextmanager
def _quiet_unless_bars():
    """transformers' GGUF loader draws its own tqdm bar ("Converting and de-quantizing GGUF tensors") whatever
    transformers' progress-bar setting, which allhere's command line turns off unless --verbose: follow it."""
    from transformers import modeling_gguf_pytorch_utils as loader
    from transformers.utils import logging

    drawn = getattr(loader, "tqdm", None)
    if drawn is None or logging.is_progress_bar_enabled():
        yield
        return
    loader.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        loader.tqdm = drawn


def load(path: str | Path, dtype: torch.dtype | str = "auto"):
    """(tokenizer, model) of the GGUF file ``path``: an ordinary transformers model (``save_pretrained`` writes
    safetensors), its weights de-quantized, in ``dtype`` ("auto": float32, the de-quantized values exactly)."""
    from transformers import AutoModelForCausalLM

    config = read_config(path)
    tokenizer = load_tokenizer(path)
    dtype = _dtype(dtype)
    p = Path(path).resolve()
    try:  # unpack every weight (transformers could otherwise keep some in blocks, with its GGUF kernels)
        from transformers import GgufConfig

        unpacked = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # transformers before GgufConfig: its loader always de-quantizes
        unpacked = {}
    try:
        with _quiet_unless_bars():
            read = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=str(p), dtype=torch.float32,
                                                        local_files_only=True, **unpacked)
        # Rebuilt rather than cleared: from_pretrained(gguf_file=) leaves transformers' GGUF quantizer on the model
        # and quantization_config in its config, so save_pretrained refuses it ("not serializable") and a saved
        # config.json would send the next load down the GGUF path again. Deleting those by hand depends on what
        # each transformers version attaches (5.24 added a whole quantizer); from_pretrained(state_dict=) is its
        # public way to build a model from tensors: the model loading a safetensors folder gives, sharing the
        # de-quantized tensors (no copy in float32).
        model = type(read).from_pretrained(None, config=config, state_dict=read.state_dict(), dtype=dtype)
    except (OSError, RuntimeError, ValueError, KeyError, NotImplementedError) as e:
        raise CheckpointError(f"{path}: the weights could not be loaded ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]})") from e
    model.config.name_or_path = str(path)
    return tokenizer, model.eval()


# A copy's record (in its folder): the file's sha256, and each path it was copied or found for with that path's
# (device, inode, size, mtime_ns, ctime_ns) when it was hashed.
RECORD = "allhere-gguf.json"


def _stat_of(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _record(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("sources"), dict) else None


def _write_record(folder: Path, record: dict) -> None:
    tmp = folder / f".{RECORD}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, folder / RECORD)


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _content_key(p: Path, stat: list[int], copies: Path) -> str:
    """The sha256 of the file ``p`` (resolved; ``stat``: its ``_stat_of``): read from a copy's record where it holds
    this path with the same device, inode, size, mtime and ctime (the ctime no tool sets back: a file rewritten with
    its mtime kept, by ``cp -p`` or ``rsync -t``, has another), else hashed."""
    for folder in copies.iterdir() if copies.is_dir() else ():
        record = _record(folder)
        if record is not None and record["sources"].get(str(p)) == stat and isinstance(record.get("sha256"), str):
            return record["sha256"]
    return _sha256(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(copies: Path, p: Path, keep: Path) -> None:
    """Remove the copies of ``copies`` no file stands for any more: the one this path ``p`` held before its content
    changed, those of files gone, the folders of the earlier naming (name, size, mtime), and the temporary folders
    of processes that died while writing one."""
    for folder in copies.iterdir():
        if folder == keep or not folder.is_dir() or folder.is_symlink():
            continue
        if folder.name.startswith("."):  # ".<name>.partial-<pid>-...": a copy being written
            pid = folder.name.rsplit(".partial-", 1)[-1].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        record = _record(folder)
        if record is None:
            if re.fullmatch(r".+-\d+-\d+", folder.name):  # keyed by name, size and mtime (earlier versions)
                shutil.rmtree(folder, ignore_errors=True)
            continue
        sources = {k: v for k, v in record["sources"].items() if k != str(p) and Path(k).is_file()}
        if not sources:
            shutil.rmtree(folder, ignore_errors=True)
        elif sources != record["sources"]:
            with contextlib.suppress(OSError):
                _write_record(folder, {**record, "sources": sources})


def as_folder(path: str | Path) -> Path:
    """An ordinary model folder (float32 safetensors, the tokenizer and chat template) holding the GGUF file
    ``path``: written once into allhere's cache (``allhere.runtime.models_cache.cache_dir() / "gguf-folders"``),
    keyed by the file's content (its sha256), and reused while the file holds the same bytes. Copies no file stands
    for any more (the path's earlier content, a file removed) are removed. For hosts that read folders only (vLLM
    with allhere's plugin).

    Keyed by the whole file's sha256, not by its size, modification time or first bytes: two fine-tunes of one
    model in one quantization have the same size and the same header (metadata and tensor table), and a file
    rewritten by ``cp -p`` or ``rsync -t`` keeps its mtime. Hashing reads the file once (about a second per GB); a
    copy's record keeps the hash with the file's inode, mtime and ctime, so an unchanged file is not read again."""
    from ..runtime.atomic_folder import fsync_tree
    from ..runtime.models_cache import cache_dir

    check(path)
    p = Path(path).resolve()
    copies = cache_dir() / "gguf-folders"
    stat = _stat_of(p)
    sha = _content_key(p, stat, copies)
    if _stat_of(p) != stat:
        raise ConfigError(f"{path} changed while it was read; serve it again once it is written")
    folder = copies / f"{p.stem}-{sha[:16]}"
    if (folder / "config.json").is_file():
        record = _record(folder) or {"sha256": sha, "sources": {}}
        if record["sources"].get(str(p)) != stat:
            with contextlib.suppress(OSError):  # a read-only cache serves all the same
                _write_record(folder, {**record, "sources": {**record["sources"], str(p): stat}})
        _remove_stale(copies, p, folder)
        return folder
    tokenizer, model = load(p)
    if _stat_of(p) != stat:
        raise ConfigError(f"{path} changed while it was read; serve it again once it is written")
    copies.mkdir(parents=True, exist_ok=True)
    _remove_stale(copies, p, folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-{os.getpid()}-", dir=copies))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _write_record(tmp, {"sha256": sha, "sources": {str(p): stat}})
        fsync_tree(tmp)
        os.rename(tmp, folder)  # whole or not at all
    except OSError:
        if not (folder / "config.json").is_file():  # not another process having written it first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
