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
import os
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


def as_folder(path: str | Path) -> Path:
    """An ordinary model folder (float32 safetensors, the tokenizer and chat template) holding the GGUF file
    ``path``: written once into allhere's cache (``allhere.models_cache.cache_dir() / "gguf-folders"``), keyed by
    the file's name, size and modification time, and reused while the file is unchanged. For hosts that read
    folders only (vLLM with allhere's plugin)."""
    from ..models_cache import cache_dir

    check(path)
    p = Path(path)
    _, size, mtime_ns = _key(p)
    folder = cache_dir() / "gguf-folders" / f"{p.stem}-{size}-{mtime_ns}"
    if (folder / "config.json").is_file():
        return folder
    tokenizer, model = load(p)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, folder)  # whole or not at all
    except OSError:
        if not (folder / "config.json").is_file():  # not another process having written it first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
