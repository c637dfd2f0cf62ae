"""One writer per run folder (``allhere.runtime.runlock``): reentrant in a process, refused to a second one with its
PID named, taken over from a process that died holding it, gone without a trace when released."""

import os
import subprocess
import sys

import pytest

from allhere.cli import main
from allhere.runtime.runlock import LOCK_NAME, RunLocked, run_lock
from allhere.validation import ConfigError

# Holds the lock on argv[1], says so on stdout, then waits to be killed.
HOLDER = """
import sys, time
from allhere.runtime.runlock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A process that holds the lock of ``tmp_path / "run"`` until killed (kill -9)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait()


def test_reentrant_and_gone_when_released(tmp_path):
    run = tmp_path / "new" / "run"
    with run_lock(run):
        assert (run / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with run_lock(tmp_path / "new" / "." / "run"):  # the same folder, however it is spelled
            (run / "result.txt").write_text("kept")
        assert (run / LOCK_NAME).exists()  # still held by the outer block
    assert sorted(p.name for p in run.iterdir()) == ["result.txt"]
    with run_lock(tmp_path / "empty"):
        pass
    assert not (tmp_path / "empty").exists()  # made for the lock, nothing written: removed again


def test_second_process_is_refused_with_the_pid(holder, tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(RunLocked, match=f"{run} is in use by process {holder.pid}, which writes a run there"):
        with run_lock(run):
            pass
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    # the command line: one line, exit 2, nothing written
    assert main(["demo", "--preset", "tiny", "--device", "cpu", "--no-progress", "--out", str(run)]) == 2
    assert capsys.readouterr().err.startswith(f"allhere demo: error: {run} is in use by process {holder.pid}, ")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    assert (run / LOCK_NAME).read_text() == f"{holder.pid}\n"


def test_lock_of_a_killed_process_is_taken_over(holder, tmp_path):
    run = tmp_path / "run"
    holder.kill()
    holder.wait()
    assert (run / LOCK_NAME).read_text() == f"{holder.pid}\n"  # left behind
    with run_lock(run):
        assert (run / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert list(run.iterdir()) == []


def test_under_torchrun_only_rank_0_checks(holder, tmp_path, monkeypatch):
    """A torchrun job is one writer: its rank 0 holds the lock, so the other ranks' check before the run must
    not see the folder as busy (it races with rank 0 taking the lock)."""
    from allhere.runtime.runlock import ensure_free

    run = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ensure_free(run)  # rank 1: not its check
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RunLocked, match=f"in use by process {holder.pid}"):
        ensure_free(run)


@pytest.mark.parametrize("target", ["a file", "no file"])
def test_a_lock_path_that_is_a_symbolic_link_is_refused(tmp_path, target):
    """The lock file is never opened through a symbolic link: the file it points to keeps its content (or is
    not created), and the refusal is one line naming the link."""
    from allhere.runtime.runlock import ensure_free

    run, other = tmp_path / "run", tmp_path / "elsewhere.txt"
    run.mkdir()
    if target == "a file":
        other.write_text("precious\n")
    (run / LOCK_NAME).symlink_to(other)

    def lock():
        with run_lock(run):
            pass

    for check in (lambda: ensure_free(run), lock):
        with pytest.raises(ConfigError, match=f"^{run / LOCK_NAME} is a symbolic link, not allhere's lock file; "
                                              r"remove it \(nothing was changed\)$"):
            check()
    assert (other.read_text() == "precious\n") if target == "a file" else not other.exists()
    assert [p.name for p in run.iterdir()] == [LOCK_NAME] and (run / LOCK_NAME).is_symlink()
