"""One writer per run folder. ``run_lock(folder)`` holds an exclusive ``fcntl.flock`` on
``folder/.allhere.lock`` while a run writes there, with the holder's PID written in the file; a second
process asking for the same folder is refused with ``RunLocked`` (one line naming that PID). The kernel
drops the lock when its process dies, however it dies (kill -9 included), so a lock left behind by a killed
run is taken over without anyone removing it.

Reentrant within a process (an experiment locks its run folder, then ``train`` locks a checkpoint folder
that may be the same one). Under torchrun the job is one writer: rank 0 takes the lock, the other ranks
take none. The lock file is removed on release, and a folder the lock created is removed again if nothing
was written into it (a refused or failed start leaves no trace).

The lock file is opened without following a symbolic link: a lock path that is one is refused (``ConfigError``),
and the file it points to is left as it is.

POSIX only (``fcntl``: Linux, macOS); Windows is not a target. On a filesystem without ``flock`` support
(some network filesystems) the run goes on unlocked.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..distributed.env import detect
from ..validation import ConfigError

LOCK_NAME = ".allhere.lock"

_held: dict[str, int] = {}  # folder (resolved) -> how many run_lock calls of this process hold it


class RunLocked(ConfigError):
    """Another process writes the run folder. The message names the folder and that process's PID."""


@contextlib.contextmanager
def run_lock(folder: str | Path):
    """Hold ``folder`` (created when missing) for this process until the block ends."""
    key = str(Path(folder).resolve())
    env = detect()
    if key in _held or (env is not None and not env.main):
        _held[key] = _held.get(key, 0) + 1
        try:
            yield
        finally:
            _held[key] -= 1
            if not _held[key]:
                del _held[key]
        return
    fd, created = _acquire(Path(key), folder)
    _held[key] = 1
    try:
        yield
    finally:
        del _held[key]
        _release(fd, Path(key), created)


def ensure_free(folder: str | Path) -> None:
    """Raise ``RunLocked`` if another process holds ``folder``; creates and changes nothing (for checks made
    before a run starts, so that a busy folder is named as busy, not judged by the files it holds). Under
    torchrun only rank 0 checks: the lock is the job's, and rank 0 may already hold it."""
    import fcntl

    path = Path(folder) / LOCK_NAME
    env = detect()
    if str(Path(folder).resolve()) in _held or (env is not None and not env.main):
        return
    try:
        fd = _open(path, os.O_RDONLY)
    except OSError:  # no lock file: nobody holds it (a symbolic link there: ConfigError)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _locked(folder, os.pread(fd, 32, 0)) from None
    except OSError:  # no flock on this filesystem
        pass
    finally:
        os.close(fd)


def _open(path: Path, flags: int) -> int:
    """``os.open`` that does not follow a symbolic link at ``path`` (ConfigError naming it) and never truncates."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError:
        if path.is_symlink():
            raise ConfigError(f"{path} is a symbolic link, not allhere's lock file; remove it (nothing was "
                              "changed)") from None
        raise


def _locked(shown, pid: bytes) -> RunLocked:
    pid = pid.decode(errors="replace").strip()  # empty: written in a moment
    return RunLocked(f"{shown} is in use by {f'process {pid}' if pid else 'another process'}, which writes a run "
                     "there; wait for it to end or stop it (Ctrl-C saves and stops), or choose another folder "
                     "(nothing was changed)")


def _acquire(folder: Path, shown: str | Path) -> tuple[int | None, bool]:
    """(file descriptor holding the lock, or None where flock is unsupported; whether the folder was made)."""
    import fcntl  # here, so that importing allhere does not need it

    path = folder / LOCK_NAME
    for _ in range(100):  # repeated only while the previous holder removes its lock file or folder
        created = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = _open(path, os.O_RDWR | os.O_CREAT)
        except FileNotFoundError:  # the folder was removed between mkdir and open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0)
            os.close(fd)
            raise _locked(shown, pid) from None
        except OSError:  # no flock on this filesystem: run unlocked
            os.close(fd)
            return None, created
        if _same_file(fd, path):  # not a file its previous holder unlinked between our open and our lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd, created
        os.close(fd)
    raise RunLocked(f"{shown}: could not take its lock file {LOCK_NAME}")


def _release(fd: int | None, folder: Path, created: bool) -> None:
    path = folder / LOCK_NAME
    if fd is not None:
        if _same_file(fd, path):  # removed while still locked: whoever opened it before sees it gone, retries
            path.unlink()
        os.close(fd)  # releases the lock
    if created:
        with contextlib.suppress(OSError):  # not empty: the run wrote something, keep it
            folder.rmdir()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
