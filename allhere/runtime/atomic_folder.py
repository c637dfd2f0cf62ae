"""A folder written whole or not at all: ``write_folder(target)`` hands out a temporary sibling of ``target``
(``.<name>.partial``, on the same filesystem) to write into; when the block ends without an error its files and
folders are fsynced and it is renamed to ``target`` in one step, so ``target`` is either absent (or as it was)
or complete, whenever the process dies (kill -9 and power loss included). An error or Ctrl-C in the block
removes the partial folder.

Where ``target`` already exists (a folder holding only the run lock, or with ``replace=True`` an earlier model),
the two folders are swapped atomically (Linux's ``renameat2(RENAME_EXCHANGE)``) and the old one removed. Where
the system has no such swap, the old folder is first renamed to ``.<name>.old``; a process killed between the
two renames leaves it there, and the next ``write_folder`` of that target puts it back.

The caller is ``target``'s only writer: it holds the run lock (``allhere.runtime.runlock``) of ``target`` or of the
folder around it. That is what makes a leftover ``.<name>.partial`` (from a killed run) safe to remove when the
next write starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from pathlib import Path

from ..validation import ConfigError
from .runlock import LOCK_NAME

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def partial_path(target: str | Path) -> Path:
    target = Path(target)
    return target.with_name(f".{target.name}.partial")


def _old_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def holds_files(folder: str | Path) -> bool:
    """Whether ``folder`` exists and holds anything but a run lock."""
    folder = Path(folder)
    return folder.is_dir() and any(f.name != LOCK_NAME for f in folder.iterdir())


def clean_stale(target: str | Path) -> list[Path]:
    """Remove what a killed ``write_folder`` of ``target`` left (its partial folder); put back an old ``target``
    a killed swap left aside. Returns the folders removed. Only ``target``'s writer may call it."""
    target = Path(target)
    removed = []
    partial, old = partial_path(target), _old_path(target)
    if partial.exists() or partial.is_symlink():
        _remove(partial)
        removed.append(partial)
    if old.is_dir() and not old.is_symlink():
        if not target.exists():
            os.rename(old, target)  # killed between the two renames: the old target comes back
        else:
            _remove(old)
            removed.append(old)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def fsync_tree(folder: str | Path) -> None:
    """Every file under ``folder`` on disk, then every folder's entries (deepest first)."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                _fsync(path, os.O_RDONLY)
        _fsync(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as e:  # a filesystem without fsync on folders (some network ones): nothing more to do there
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one step; False where the system cannot (not Linux, an old kernel or C
    library, a filesystem without it)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(partial: Path, target: Path) -> None:
    """``partial`` (written and fsynced) becomes ``target``; an existing ``target`` ends up in ``partial``'s
    place (or ``.<name>.old``), for the caller to remove."""
    if not target.exists():
        os.rename(partial, target)
    elif not _exchange(partial, target):
        old = _old_path(target)
        os.rename(target, old)
        os.rename(partial, target)
        os.rename(old, partial)
    _fsync(target.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


@contextlib.contextmanager
def write_folder(target: str | Path, replace: bool = False):
    """Yield a new, empty temporary folder beside ``target``; when the block ends normally, it becomes ``target``
    whole (see the module docstring). ``replace``: an existing ``target`` that holds files (an earlier model) is
    replaced; without it such a ``target`` is refused (ConfigError, nothing changed) -- one holding only a run
    lock is not. A ``target`` that is a symbolic link is written where it points (its sibling there: the same
    filesystem)."""
    target = Path(os.path.realpath(target))
    clean_stale(target)
    partial = partial_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    try:
        yield partial
        if not replace and holds_files(target):
            raise ConfigError(f"{target} already holds files; choose a new folder (nothing was written)")
        fsync_tree(partial)
        publish(partial, target)
    finally:
        if partial.exists():  # the unfinished folder, or after the swap the old target
            shutil.rmtree(partial, ignore_errors=True)
