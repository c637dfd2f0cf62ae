"""Argument types and shared flags of the command line.

Every option with a value goes through one of these types, so a bad value is refused while the command
line is parsed -- before any run folder is claimed, any model loaded or any step trained -- with one line
``allhere <command>: error: argument --option: what was expected, got 'value'``. Each type's
``__name__`` says what it accepts (argparse prints it for values it cannot convert; tests key on it).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

Bad = argparse.ArgumentTypeError


def _named(name: str):
    def wrap(fn):
        fn.__name__ = name
        return fn

    return wrap


# Numbers ----------------------------------------------------------------------------------------------

def integer(low: int):
    """Integers >= low."""

    @_named(f"integer>={low}")
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise Bad(f"expected an integer >= {low}, got {value!r}") from None
        if n < low:
            raise Bad(f"expected an integer >= {low}, got {value!r}")
        return n

    return parse


def number(low: float, strict: bool = False, below: float | None = None):
    """Finite numbers >= low (> low when ``strict``), and < ``below`` when given."""
    want = f"a finite number {'>' if strict else '>='} {low:g}" + (f" and < {below:g}" if below is not None else "")

    @_named(f"number{'>' if strict else '>='}{low:g}" + (f"<{below:g}" if below is not None else ""))
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise Bad(f"expected {want}, got {value!r}") from None
        if not math.isfinite(x) or x < low or (strict and x == low) or (below is not None and x >= below):
            raise Bad(f"expected {want}, got {value!r}")
        return x

    return parse


positive, positive_or_zero = integer(1), integer(0)


HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"


@_named("host")
def host(value: str) -> str:
    """An IP address or a host name (labels of letters, digits and '-'); a dotted number must be an address."""
    import ipaddress
    import re

    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", value) or not re.fullmatch(rf"{HOST_LABEL}(?:\.{HOST_LABEL})*", value):
        raise Bad(f"expected an IP address or a host name, got {value!r}")
    return value


@_named("port")
def port(value: str) -> int:
    n = integer(1)(value)
    if n > 65535:
        raise Bad(f"expected a port number in 1..65535, got {value!r}")
    return n
nonnegative, positive_number, fraction = number(0), number(0, strict=True), number(0, strict=True, below=1)


# Devices ----------------------------------------------------------------------------------------------

@_named("device")
def device(value: str) -> str:
    """auto, cpu or cuda[:N] -- a CUDA device that this machine has."""
    import torch

    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cpu":
        return value
    index = value[5:] if value.startswith("cuda:") else "0" if value == "cuda" else None
    if index is None or not index.isdigit():
        raise Bad(f"expected auto, cpu or cuda[:N], got {value!r}")
    if not torch.cuda.is_available():
        raise Bad(f"{value!r}: this machine has no CUDA device (torch {torch.__version__}); use --device cpu")
    if int(index) >= torch.cuda.device_count():
        raise Bad(f"{value!r}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    return value


# Paths ------------------------------------------------------------------------------------------------

def _existing(value: str) -> Path:
    p = Path(value)
    if not p.exists():
        raise Bad(f"no such file or folder: {value!r}")
    if not os.access(p, os.R_OK):
        raise Bad(f"cannot read {value!r} (permission denied)")
    return p


@_named("data path")
def data_path(value: str) -> str:
    """An existing file or folder (its contents are checked where it is read)."""
    _existing(value)
    return value


@_named("file")
def existing_file(value: str) -> str:
    if _existing(value).is_dir():
        raise Bad(f"expected a file, got the folder {value!r}")
    return value


@_named("folder")
def existing_folder(value: str) -> str:
    if not _existing(value).is_dir():
        raise Bad(f"expected a folder, got the file {value!r}")
    return value


@_named("model folder")
def model_folder(value: str) -> str:
    """A folder saved by transformers' ``save_pretrained`` (it has a config.json), a GGUF file, or the name of a
    known model (``allhere fetch``) when no file or folder has that name: its cached file."""
    p = Path(value)
    if not p.exists() and os.sep not in value:
        from ..runtime.models_cache import KNOWN, model_path
        from ..validation import ConfigError

        if value in KNOWN:
            try:
                return str(model_path(value))
            except ConfigError as e:  # not fetched
                raise Bad(str(e)) from None
    if _existing(value).is_dir():
        if not (p / "config.json").is_file():
            raise Bad(f"{value!r} is not a saved transformers model (no config.json in it)")
        return value
    from ..hf.gguf import is_gguf

    if not is_gguf(p):
        raise Bad(f"expected a transformers model folder or a GGUF file, got the file {value!r}")
    return value


@_named("model folder")
def model_or_fetchable(value: str) -> str:
    """What ``model_folder`` takes, or the name of a known model that is not fetched yet, as given: the command
    fetches it (``allhere.runtime.models_cache.fetch``)."""
    from ..runtime.models_cache import KNOWN

    try:
        return model_folder(value)
    except Bad:
        if value in KNOWN and not Path(value).exists():
            return value
        raise


@_named("checkpoint or model folder")
def checkpoint_or_model(value: str) -> str:
    """An allhere checkpoint (a .safetensors file), or what ``model_folder`` takes."""
    p = Path(value)
    if p.suffix == ".safetensors" and not p.is_dir():
        _existing(value)
        return value
    if p.is_file():
        try:
            return model_folder(value)
        except Bad:
            raise Bad(f"expected an allhere checkpoint (*.safetensors), a transformers model folder or a GGUF file, "
                      f"got {value!r}") from None
    return model_folder(value)


@_named("output folder")
def out_folder(value: str) -> str:
    """A folder that exists or can be created: not a file, under no file, in a writable place. What it
    may already hold is for each command to decide."""
    p = Path(value)
    if p.exists() and not p.is_dir():
        raise Bad(f"{value!r} is a file, not a folder")
    base = p.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise Bad(f"cannot create the folder {value!r}: {base} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise Bad(f"cannot write in {base} (permission denied)")
    try:  # the permission bits do not tell everything (root, read-only mounts, /proc): try it
        os.rmdir(tempfile.mkdtemp(prefix=".allhere-check-", dir=base))
    except OSError as e:
        raise Bad(f"cannot create the folder {value!r} in {base} ({e.strerror})") from None
    return value


@_named("text")
def text(value: str) -> str:
    """Non-empty text."""
    if not value.strip():
        raise Bad(f"expected some text, got {value!r}")
    return value


@_named("comma-separated names")
def names(value: str) -> list[str]:
    parts = [part.strip() for part in value.split(",")]
    if not value.strip() or not all(parts):
        raise Bad(f"expected comma-separated names without empty entries, got {value!r}")
    return parts


# Shared flags -----------------------------------------------------------------------------------------

GGUF_HELP = "a GGUF file (de-quantized to float32), or a fetched model's name (allhere fetch: smollm2)"
DEVICE_HELP = "auto (default: the first GPU if there is one, else cpu), cpu or cuda[:N]"
DATA_HELP = ("your own text instead of the stdlib corpus: a UTF-8 text file, a folder of text files, or a "
             "datasets folder saved with save_to_disk (column 'text'); default: the stdlib corpus")


def task_flag(p: argparse.ArgumentParser, verb: str, tasks: tuple[str, ...]) -> None:
    p.add_argument("--task", dest="tasks", action="append", choices=tasks,
                   help=f"{verb} only this task (repeatable); default: {' and '.join(tasks)}")


def preset_flag(p: argparse.ArgumentParser, presets: tuple[str, ...], more: str = "") -> None:
    p.add_argument("--preset", default="cpu", choices=presets,
                   help="sizes and steps: cpu (default; `allhere demo` takes about 5 min on 2 cores from the "
                        f"shipped bases, 10 with --pretrain), tiny (seconds), gpu{more}")


@_named("report")
def report(value: str) -> str:
    """--report-to: "tensorboard" only where the tensorboard package is installed (argparse checks the choices)."""
    from ..runtime.reporting import INSTALL, tensorboard_installed

    if value == "tensorboard" and not tensorboard_installed():
        raise Bad(f"'tensorboard' needs the tensorboard package: {INSTALL} (or --report-to none)")
    return value


def report_flag(p: argparse.ArgumentParser) -> None:
    from ..runtime.reporting import REPORT_TO

    p.add_argument("--report-to", type=report, choices=REPORT_TO, default=None,
                   help="training curves (loss, mu_f, lambda, learning rate, tokens/s, held-out numbers, mu_f "
                        "heatmaps): tensorboard writes event files in each training run's folder "
                        "(<run>/tensorboard/; see them with `tensorboard --logdir <out>`), none writes nothing "
                        "(default: tensorboard when the tensorboard package is installed, else none)")


def progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true",
                   help="no progress reports (default: a bar on a terminal, else a line every 5%%)")


def data_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=data_path, default=None, help=DATA_HELP)


DEVICE_HELPS = {"auto": DEVICE_HELP, "cpu": "cpu (default), cuda[:N] or auto"}


def device_flag(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--device", type=device, default=default, help=DEVICE_HELPS[default])


def repeats_flag(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--repeats", type=positive, default=default,
                   help=f"timed calls per measurement, median (default {default})")


def model_flag(p: argparse.ArgumentParser) -> None:
    """--model of the commands that convert a model (convert, sft)."""
    p.add_argument("--model", type=model_folder, required=True,
                   help=f"folder of a saved transformers causal LM, {GGUF_HELP} (required)")


def conversion_flags(p: argparse.ArgumentParser, kinds: tuple[str, ...]) -> None:
    p.add_argument("--mechanism", default="aha", choices=kinds, help=f"{' or '.join(kinds)} (default aha)")
    p.add_argument("--window", type=positive_or_zero, required=True,
                   help="window w (keys, the current one included); DAR also takes 0 (uniform reduction)")
    p.add_argument("--tau", type=fraction, default=None, help="AHA gate threshold, 0 < tau < 1 (default 0.5)")
    p.add_argument("--lam", type=nonnegative, default=None, help="AHA lambda of L_reg (default 3e-4)")
    p.add_argument("--sinks", type=positive_or_zero, default=None,
                   help="AHA: the first N tokens every local (token, head) reads besides its window (attention "
                        "sinks, fewer than --window; default 0, the paper's AHA)")
    p.add_argument("--layers", default="full", choices=("full", "all"),
                   help="full: the mechanism goes on the full-attention layers, a hybrid model's sliding-window "
                        "layers stay as they are (default); all: on every layer (Mistral-7B-v0.1: replacing "
                        "the window all its layers share)")
    p.add_argument("--d-down", type=positive, default=None,
                   help="DAR bottleneck width (required with dar and dar_latent; no default)")
    p.add_argument("--rope-pairs", type=positive_or_zero, default=None,
                   help="dar_latent: rotary frequency pairs per kv head kept rotated for distant keys (default 4; "
                        "MHA2MLA's head_dim / 16)")
