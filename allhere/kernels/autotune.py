"""Launch settings chosen on the GPU the kernels run on, remembered across processes.

The first call of a kernel for a shape class (``key``: head dim, dtype, grouped-query group, a power-of-two
length bucket, and for decode the batch x heads bucket) times each of its candidates (``tiles.prune``:
a handful, pruned for this device) on the call's own tensors with ``triton.testing.do_bench`` and keeps
the fastest; every kernel here writes its outputs without reading them, so timing it on the real call is
harmless. A candidate that does not compile on the device is skipped. The choice is kept for the process
and written to a JSON file (``store_path``: ``$XDG_CACHE_HOME/allhere/kernel-settings.json``, i.e.
``~/.cache/allhere/``, keyed by device, triton version and kernel), so later processes start tuned.

Where the setting comes from, first match wins:
  1. ``pinned()``: a fixed setting for reproducible runs (each kernel's default, or settings you give);
  2. Triton's interpreter (CPU tests): the default, never timed;
  3. this process's earlier choice, then the file;
  4. tuning now (its cost is in ``choices()``); while a CUDA graph is being captured (a captured decode step,
     vLLM's or torch.compile's CUDA graphs) nothing is timed: the first candidate runs, and is not kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from . import tiles

_PINNED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("allhere_pinned_tiles", default=None)
_CHOSEN: dict[str, dict] = {}  # "device|triton|kernel|key" -> record (this process)
_STORE: dict = {"path": None, "read": False, "entries": {}}


@contextlib.contextmanager
def pinned(settings: dict[str, dict] | None = None):
    """Within the block every kernel launches with a fixed setting, never tuned: the first of its
    candidates that this GPU can run (``tiles.prune``; in the interpreter its default), with what
    ``settings[kernel]`` gives put over it. Kernels: "sliding", "global", "local_dq", "global_dq", "dkdv",
    "decode"."""
    unknown = set(settings or {}) - set(tiles.SPACES)
    if unknown:
        raise ValueError(f"pinned(): unknown kernel(s) {sorted(unknown)}; the kernels are {sorted(tiles.SPACES)}")
    token = _PINNED.set(dict(settings or {}))
    try:
        yield
    finally:
        _PINNED.reset(token)


def pins() -> dict | None:
    """The settings of the innermost ``pinned`` block (None outside one), to re-enter it elsewhere, e.g. in
    a backward pass that autograd runs on another thread: ``with pinned(saved): ...``."""
    fixed = _PINNED.get()
    return None if fixed is None else dict(fixed)


def store_path() -> Path:
    """The file that keeps the choices across processes."""
    if _STORE["path"] is None:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        _STORE["path"] = Path(base) / "allhere" / "kernel-settings.json"
    return Path(_STORE["path"])


def set_store_path(path: str | os.PathLike | None) -> None:
    """Keep the choices in ``path`` (read lazily); None: back to the default file."""
    _STORE.update(path=None if path is None else Path(path), read=False, entries={})


def length_bucket(n: int) -> int:
    """The power of two at or above ``n`` (at least 256): lengths in one bucket share a setting."""
    return max(256, 1 << (max(int(n), 1) - 1).bit_length())


def setting(kernel: str, key: tuple, device: torch.device, launch: Callable[[dict], None],
            head_dim: int, elem: int, length: int | None = None) -> dict:
    """The launch setting of ``kernel`` for shape class ``key`` on ``device`` (see the module docstring);
    ``launch(setting)`` runs the kernel with a setting (used for timing when tuning)."""
    fixed = _PINNED.get()
    if device.type != "cuda":  # Triton's interpreter
        return {**tiles.default(kernel), **(fixed or {}).get(kernel, {})}
    if fixed is not None:
        return {**_candidates(kernel, device, head_dim, elem, length)[0], **fixed.get(kernel, {})}
    ident = _identity(kernel, key, device)
    if ident not in _CHOSEN:
        stored = _stored().get(ident)
        if stored is not None:
            _CHOSEN[ident] = {**stored, "source": "file", "tuning_s": 0.0}
        elif capturing():  # a CUDA graph being captured: timing would break it
            return _candidates(kernel, device, head_dim, elem, length)[0]  # not kept: an eager call tunes
        else:
            _CHOSEN[ident] = _tune(kernel, device, launch, head_dim, elem, length)
            _save(ident, _CHOSEN[ident])
    return dict(_CHOSEN[ident]["setting"])


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def choices() -> list[dict]:
    """What this process chose: per (device, kernel, key) the setting, its time (ms), how many candidates
    were timed, the seconds spent tuning (0 when read from the file) and the source ("tuned" | "file")."""
    return [{"id": ident, **record} for ident, record in _CHOSEN.items()]


def forget() -> None:
    """Drop this process's choices (the file stays): the next calls read the file or tune again."""
    _CHOSEN.clear()
    _STORE.update(read=False, entries={})


def _identity(kernel: str, key: tuple, device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{_device_tag(index)}|{kernel}|" + "-".join(str(part) for part in key)


@functools.lru_cache(maxsize=None)
def _device_tag(index: int) -> str:
    """"<GPU name> sm<capability>|triton <version>" of CUDA device ``index`` (asked once: every launch needs it)."""
    import triton

    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm{major}{minor}|triton {triton.__version__}"


def _candidates(kernel: str, device: torch.device, head_dim: int, elem: int, length: int | None) -> list[dict]:
    from triton.runtime import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    shared = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return tiles.prune(kernel, head_dim, elem, torch.cuda.get_device_capability(index), shared, length)


def _bench(fn: Callable[[], None]) -> float:
    """Milliseconds per call of ``fn`` on the GPU (Triton's ``do_bench``: warm-up, then ~25 ms of calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25)


def _tune(kernel: str, device: torch.device, launch, head_dim: int, elem: int, length: int | None) -> dict:
    start, timings, failures = time.perf_counter(), [], []
    for candidate in _candidates(kernel, device, head_dim, elem, length):
        try:
            timings.append((_bench(lambda: launch(candidate)), candidate))
        except Exception as err:  # does not compile or launch on this device (shared memory, registers)
            failures.append(f"{candidate}: {type(err).__name__}")
    if not timings:
        raise RuntimeError(f"no launch setting of the {kernel} kernel runs on this GPU: {'; '.join(failures)}")
    ms, best = min(timings, key=lambda t: t[0])
    return {"setting": best, "ms": round(ms, 4), "tried": len(timings), "failed": len(failures),
            "tuning_s": round(time.perf_counter() - start, 2), "source": "tuned"}


def _stored() -> dict:
    if not _STORE["read"]:
        _STORE["read"] = True
        try:
            _STORE["entries"] = json.loads(store_path().read_text()).get("entries", {})
        except (OSError, ValueError, AttributeError):  # none yet, or unreadable: tune again, rewrite
            _STORE["entries"] = {}
    return _STORE["entries"]


def _save(ident: str, record: dict) -> None:
    """Adds one choice to the file (re-read first: another process may have added its own), atomically."""
    path = store_path()
    _STORE["read"] = False
    entries = dict(_stored())
    entries[ident] = {k: record[k] for k in ("setting", "ms", "tried")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
        _STORE["entries"] = entries
    except OSError:  # a read-only home: the choice holds for this process only
        pass
