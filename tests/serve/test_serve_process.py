"""``allhere serve``'s handling of the server process, without vLLM: stand-in processes that never get ready, die
at once, answer /health, spawn children or lose their parent. vLLM's own server under the same handling is
tested in test_serve_e2e.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from allhere.serve.server_process import PARENT_ENV, child_command, stop, wait_ready
from allhere.validation import ConfigError


def start(main: str, log: Path | None = None, parent: int | None = None) -> subprocess.Popen:
    """``main`` run as allhere serve runs vLLM: through its child command, in a session of its own."""
    out = open(log, "w") if log else subprocess.DEVNULL
    env = {**os.environ, PARENT_ENV: str(parent or os.getpid())}
    return subprocess.Popen(child_command(main), env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_dies_before_it_is_ready(tmp_path):
    log = tmp_path / "vllm.log"
    proc = start("print('loading'); print('ValueError: no room for the KV cache'); raise SystemExit(3)", log)
    with pytest.raises(ConfigError, match=r"stopped before it was ready \(exit code 3\): ValueError: no room for "
                                          r"the KV cache \(whole log: "):
        wait_ready(proc, f"http://127.0.0.1:{free_port()}", 30, log)


def test_a_server_that_never_gets_ready_is_given_up_and_stopped(tmp_path):
    log = tmp_path / "vllm.log"
    proc = start("import time; print('still loading', flush=True); time.sleep(60)", log)
    start_time = time.monotonic()
    with pytest.raises(ConfigError, match=r"not ready after 1 s \(its /health never answered 200; --ready-timeout "
                                          r"waits longer\); stopped it: still loading"):
        wait_ready(proc, f"http://127.0.0.1:{free_port()}", 1, log)
    stop(proc)
    assert time.monotonic() - start_time < 10 and proc.returncode is not None


def test_ready_only_when_health_answers_200(tmp_path):
    """A server that listens but answers /health 503 first is not ready until its 200."""
    port = free_port()
    main = f"""
import http.server, time
started = time.monotonic()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and time.monotonic() - started > 1.5
        self.send_response(200 if ok else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
"""
    proc = start(main, tmp_path / "log")
    try:
        took = wait_ready(proc, f"http://127.0.0.1:{port}", 30, tmp_path / "log")
        assert took >= 1.5
    finally:
        stop(proc)


def test_stop_ends_the_whole_group(tmp_path):
    """SIGTERM to the group: the server's children too (vLLM's engine processes), also one that ignores SIGTERM
    (SIGKILL after the grace), and also where the server itself has ended already."""
    pids = tmp_path / "pids"
    main = f"""
import signal, subprocess, sys, time
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
stubborn = subprocess.Popen([sys.executable, "-c", ignore])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open({str(pids)!r}, "w").write(f"{{stubborn.pid}} {{child.pid}}")
time.sleep(60)
"""
    proc = start(main)
    deadline = time.monotonic() + 20
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # the stubborn one has set its handler
    below = [int(p) for p in pids.read_text().split()]
    stop(proc, grace=1.0)
    assert all(gone(p) for p in below) and proc.returncode is not None
    # the leader gone first, a child left: still stopped
    main = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open({str(pids)!r}, "w").write(str(child.pid))
"""
    pids.unlink()
    proc = start(main)
    proc.wait(20)
    child = int(pids.read_text())
    assert running(child)
    stop(proc, grace=5.0)
    assert gone(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_the_server_dies_with_allhere(tmp_path):
    """allhere's process killed by SIGKILL (no handler runs): the kernel sends the server SIGTERM. The child asks for
    it itself (no preexec_fn); one whose parent is already gone when it asks stops at once."""
    pid_file = tmp_path / "pid"
    parent = f"""
import os, subprocess, time
proc = subprocess.Popen({child_command("import time; time.sleep(60)")!r},
                        env={{**os.environ, {PARENT_ENV!r}: str(os.getpid())}}, start_new_session=True)
open({str(pid_file)!r}, "w").write(str(proc.pid))
time.sleep(60)
"""
    launcher = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.05)
    server = int(pid_file.read_text())
    time.sleep(0.5)  # the child has asked for the signal
    assert running(server)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert gone(server)
    orphan = start("import time; time.sleep(60)", tmp_path / "log", parent=1)  # "started" by a process long gone
    assert orphan.wait(10) == 1
    assert "the process that started this server is gone" in (tmp_path / "log").read_text()


def test_old_server_folders_are_pruned_but_never_a_running_ones(tmp_path):
    """``allhere serve``'s folders in the temp dir (vLLM's log): the last ones kept, older ones removed, never the
    folder of a server that still runs (it holds the folder's run lock), nor anything not named as one."""
    import fcntl

    from allhere.runtime.runlock import LOCK_NAME
    from allhere.serve.server_process import WORK_PREFIX, prune_work_folders

    folders = []
    for i in range(6):
        folder = tmp_path / f"{WORK_PREFIX}{i}"
        folder.mkdir()
        (folder / "vllm.log").write_text(f"server {i}\n")
        (folder / LOCK_NAME).write_text("1\n")  # as a server writes it (removed when it stops)
        for p in (folder / "vllm.log", folder / LOCK_NAME, folder):
            os.utime(p, (1000 + i, 1000 + i))  # folder i started at second i
        folders.append(folder)
    os.utime(folders[2] / "vllm.log", (9999, 9999))  # an old server whose log grew last: among the recent ones
    held = os.open(folders[0] / LOCK_NAME, os.O_RDWR)  # the oldest still runs
    fcntl.flock(held, fcntl.LOCK_EX)
    (tmp_path / "other").mkdir()
    (tmp_path / f"{WORK_PREFIX}file").write_text("not a server's folder")
    try:
        removed = prune_work_folders(tmp_path, keep=3)
    finally:
        os.close(held)
    assert sorted(removed) == [folders[1], folders[3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["other", f"{WORK_PREFIX}file"] + [f.name for f in folders if f not in removed])
    assert prune_work_folders(tmp_path, keep=3) == [folders[0]]  # stopped since: removed the next time


def test_serve_holds_its_folder_and_prunes_the_old_ones(tmp_path, monkeypatch):
    """``allhere.serve.launch.serve`` with a stand-in for vLLM (a module that imports, a server that fails at once):
    the old folders beyond the last ones go at the start, the new one is locked while the server runs and keeps
    its log afterwards."""
    import json
    import tempfile
    import types

    from allhere.runtime.runlock import LOCK_NAME
    from allhere.serve import launch
    from allhere.serve.server_process import KEEP_WORK, WORK_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    old = []
    for i in range(KEEP_WORK + 2):
        folder = tmp_path / f"{WORK_PREFIX}old{i:02d}"
        folder.mkdir()
        os.utime(folder, (1000 + i, 1000 + i))
        old.append(folder)
    seen = tmp_path / "seen.json"  # what the stand-in server finds in its folder
    main = (f"import json, os, pathlib; work = pathlib.Path(os.environ['{launch.MULTIPROC_ENV}']).parent; "
            f"pathlib.Path({str(seen)!r}).write_text(json.dumps(sorted(os.listdir(work)))); "
            "print('ValueError: no such server'); raise SystemExit(3)")
    monkeypatch.setattr(launch, "child_command", lambda: [sys.executable, "-c", main])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 2,
                                                   "hidden_size": 128, "max_position_embeddings": 64}))
    with pytest.raises(ConfigError, match="no such server"):
        launch.serve(str(model), port=free_port(), stats_every=30)
    assert LOCK_NAME in json.loads(seen.read_text())  # held while the server ran
    left = set(tmp_path.glob(f"{WORK_PREFIX}*"))
    new = left - set(old)
    assert left == set(old[3:]) | new and len(new) == 1  # the last KEEP_WORK, the new one included
    assert [p.name for p in new.pop().iterdir()] == ["vllm.log"]  # its log kept; its lock and metrics gone
