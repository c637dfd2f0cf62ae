"""Run directories: a folder belongs to one set of settings (``settings.json``); files written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from allhere.runtime.model_checkpoint import atomic_write
from allhere.runtime.runlock import LOCK_NAME
from allhere.validation import ConfigError

SETTINGS = "settings.json"


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a crash leaves the old file or none, never half of one)."""
    atomic_write(Path(path), lambda tmp: tmp.write_text(text))


def write_json(path: Path, data, indent: int | None = 1) -> None:
    """Write ``data`` as json (one trailing newline) to ``path`` atomically."""
    write_text(path, json.dumps(data, indent=indent) + "\n")


def check_out(out: Path) -> None:
    """Refuse (ConfigError) an output folder that holds files but no allhere run: a model, a checkpoint,
    anybody's other files. A folder of runs (``*/settings.json``) is for ``claim`` to judge; the lock of the
    run that writes it (``allhere.runtime.runlock``) is no file of anybody's."""
    out = Path(out)
    if out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()) and not any(out.glob(f"*/{SETTINGS}")):
        raise ConfigError(f"--out {out} holds files but no allhere run; choose a new or empty folder "
                          "(nothing was changed)")


def claim(run: Path, settings: dict, upgrade: Callable[[dict], dict] | None = None) -> None:
    """Reuse ``run`` for the same ``settings``, start it for new ones, refuse it (ConfigError, nothing
    changed) when it holds a run with other settings. Claim a run only once its inputs are known good:
    a failed start must not leave a settings file behind that blocks the next, corrected one.
    ``upgrade`` reads saved settings back through their dataclasses, so that a field added since (at its
    default) does not make a run written by an earlier version look different."""
    path = Path(run) / SETTINGS
    text = json.dumps(settings, indent=1, sort_keys=True)
    if path.exists():
        saved = _read_json(path)
        if upgrade is not None:
            try:
                saved = json.loads(json.dumps(upgrade(saved)))
            except (TypeError, KeyError, ValueError):  # unknown fields or bad values: other settings
                pass
        if saved != json.loads(text):
            raise ConfigError(f"{run} holds a run with other settings; choose another --out (nothing was changed)")
        return
    write_text(path, text + "\n")


def read_settings(run: Path, job: str = "demo") -> dict:
    """The settings a run directory was claimed with (ConfigError when it holds none)."""
    path = Path(run) / SETTINGS
    if not path.exists():
        raise ConfigError(f"{run} holds no finished {job} task (no {SETTINGS}); run allhere {job} first")
    return _read_json(path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is damaged ({e}); move the run folder away or choose another --out "
                          "(nothing was changed)") from None
