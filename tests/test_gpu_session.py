"""benchmarks/gpu_session.py's own plumbing, on the CPU with stand-in parts: caps, the deadline, the
files it leaves (the GPU parts themselves only run on a lent device)."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def session(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "benchmarks" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_session", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def py(code):
    return (sys.executable, "-c", code)


def test_a_part_runs_its_commands_in_order_and_stops_at_the_first_failure(session, tmp_path):
    part = session.Part(60, "p.log", (py("print('first')"), py("import sys; print('second'); sys.exit(3)"),
                                      py("print('never')")))
    result, took = session.run_part(part, tmp_path, 60, str(tmp_path))
    log = (tmp_path / "p.log").read_text()
    assert result.startswith("exit 3 in") and "first\n" in log and "second\n" in log and "never" not in log
    assert log.count("$ ") == 2


def test_commands_find_allhere_without_an_install(session, tmp_path, monkeypatch):
    """On the device nothing is installed: each command runs from the repository root with it first on
    PYTHONPATH (a script in benchmarks/ imports allhere from there)."""
    monkeypatch.chdir(tmp_path)
    part = session.Part(60, "p.log", (py("import os; print(os.getcwd()); print(os.environ['PYTHONPATH'])"),))
    assert session.run_part(part, tmp_path, 60, str(tmp_path))[0] == "ok"
    cwd, path = (tmp_path / "p.log").read_text().splitlines()[1:3]
    assert Path(cwd) == ROOT and path.split(os.pathsep)[0] == str(ROOT)


def test_a_part_past_its_cap_is_killed_with_its_children(session, tmp_path):
    marker = tmp_path / "child-finished"
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).write_text('x')"
    part = session.Part(1, "p.log", (py(f"import subprocess, sys, time; print('started', flush=True); "
                                        f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)"),))
    t0 = time.monotonic()
    result, _ = session.run_part(part, tmp_path, 1, str(tmp_path))
    assert result.startswith("stopped at the cap") and time.monotonic() - t0 < 10
    assert "started" in (tmp_path / "p.log").read_text()
    time.sleep(4)
    assert not marker.exists()  # the whole process group went, not only the part's first process


def test_the_session_stops_at_its_deadline_and_names_the_parts_left(session, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(session, "PARTS", {
        "quick": session.Part(30, "quick.log", (py("print('quick done')"),)),
        "slow": session.Part(30, "slow.log", (py("import time; time.sleep(60)"),)),
        "late": session.Part(30, "late.log", (py("print('late')"),)),
    })
    monkeypatch.setattr(session, "MIN_START", 1)
    monkeypatch.setattr(session, "versions", lambda: "torch, triton, transformers: versions")
    rc = session.main(["--deadline", "3", "--out", str(tmp_path)])
    summary = (tmp_path / "session.md").read_text()
    assert rc == 1
    assert "| quick | 30 |" in summary and "| ok | quick.log |" in summary
    assert "stopped at the cap" in summary and not (tmp_path / "late.log").exists()
    assert "Not started (deadline of 3 s): late" in summary
    assert "gpu_session.py late --deadline" in summary
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_unknown_parts_and_caps_are_refused(session):
    with pytest.raises(SystemExit) as e:
        session.main(["nonsense"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="PART=SECONDS"):
        session.main(["--cap", "bench=soon"])


def test_the_real_parts_fit_what_the_device_brings_back(session, capsys):
    assert len({p.log for p in session.PARTS.values()}) + 1 <= 8  # one file per part, and session.md
    assert session.main(["--plan"]) == 0
    assert "caps add up to" in capsys.readouterr().out
