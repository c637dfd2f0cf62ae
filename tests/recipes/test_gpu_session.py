"""benchmarks/gpu_session.py's own plumbing, on the CPU with stand-in parts: caps, the deadline, the
files it leaves (the GPU parts themselves only run on a lent device)."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def session(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "benchmarks" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_session", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def py(code):
    return (sys.executable, "-c", code)


def test_a_part_runs_every_command_and_reports_each_failure(session, tmp_path):
    part = session.Part(60, "p.log", (py("print('first')"), py("import sys; print('second'); sys.exit(3)"),
                                      py("print('third')")))
    result, took = session.run_part(part, tmp_path, 60, str(tmp_path))
    log = (tmp_path / "p.log").read_text()
    assert result == "exit 3 in `-c import sys; print('second'); sys.exit(3)`"  # the one failure, whole argv
    assert "first\n" in log and "second\n" in log and "third\n" in log and log.count("$ ") == 3


def test_commands_find_allhere_without_an_install(session, tmp_path, monkeypatch):
    """On the device nothing is installed: each command runs from the repository root with it first on
    PYTHONPATH (a script in benchmarks/ imports allhere from there)."""
    monkeypatch.chdir(tmp_path)
    part = session.Part(60, "p.log", (py("import os; print(os.getcwd()); print(os.environ['PYTHONPATH'])"),))
    assert session.run_part(part, tmp_path, 60, str(tmp_path))[0] == "ok"
    cwd, path = (tmp_path / "p.log").read_text().splitlines()[1:3]
    assert Path(cwd) == ROOT and path.split(os.pathsep)[0] == str(ROOT)


@pytest.mark.slow
def test_a_part_past_its_cap_is_interrupted_then_killed_with_its_children(session, tmp_path, monkeypatch):
    """At the cap the command's process group gets an interrupt first (pytest then prints its failures so
    far), and is killed when it ignores it; children go too, and later commands of the part do not start."""
    monkeypatch.setattr(session, "GRACE", 1)
    marker = tmp_path / "child-finished"
    child = f"import time, pathlib; time.sleep(4); pathlib.Path({str(marker)!r}).write_text('x')"
    interrupted = py("import time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    print('interrupted')\n"
                     "    raise")
    stubborn = py(f"import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  f"print('started', flush=True); subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)")
    for argv, said in ((interrupted, "interrupted"), (stubborn, "started")):
        part = session.Part(2, "p.log", (argv, py("print('after')")))
        t0 = time.monotonic()
        result, _ = session.run_part(part, tmp_path, 2, str(tmp_path))
        assert result.startswith(session.CAPPED) and time.monotonic() - t0 < 10
        log = (tmp_path / "p.log").read_text()
        assert said in log and "after" not in log
    time.sleep(5)
    assert not marker.exists()  # the whole process group went, not only the part's first process


@pytest.mark.slow
def test_the_session_stops_at_its_deadline_and_names_the_parts_left(session, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(session, "PARTS", {
        "quick": session.Part(30, "quick.log", (py("print('quick done')"),)),
        "slow": session.Part(60, "slow.log", (py("import time; time.sleep(60)"),)),
        "late": session.Part(30, "late.log", (py("print('late')"),)),
    })
    monkeypatch.setattr(session, "MIN_START", 1)
    monkeypatch.setattr(session, "GRACE", 1)
    monkeypatch.setattr(session, "versions", lambda: "torch, triton, transformers: versions")
    state = ["--state", str(tmp_path / "state.json")]
    rc = session.main(["--deadline", "8", "--out", str(tmp_path), *state])
    summary = (tmp_path / "session.md").read_text()
    assert rc == 1 and summary in capsys.readouterr().out  # the summary ends the output too
    assert "| quick | 30 |" in summary and "| ok | quick.log |" in summary
    assert "| slow | 60 |" in summary and session.CAPPED in summary and not (tmp_path / "late.log").exists()
    assert "Not started (under the 1 s that late needs were left before the deadline of 8 s): late." in summary
    assert "Stopped at the cap: slow." in summary
    assert "`python3 benchmarks/gpu_session.py slow late --cap slow=120 --deadline SECONDS`" in summary

    # The next call on the same machine, without looking: what is left, the capped part with twice its cap.
    assert session.main(["--continue", "--plan", *state]) == 0
    plan = capsys.readouterr().out
    assert "slow: cap 120 s" in plan and "late: cap 30 s" in plan and "quick" not in plan
    monkeypatch.setitem(session.PARTS, "slow", session.Part(60, "slow.log", (py("print('slow done')"),)))
    assert session.main(["--continue", "--deadline", "60", "--out", str(tmp_path), *state]) == 0
    summary = (tmp_path / "session.md").read_text()
    assert "| slow | 120 |" in summary and "| late | 30 |" in summary and "quick" not in summary
    assert "late\n" in (tmp_path / "late.log").read_text()
    assert session.main(["--continue", *state]) == 0 and "nothing left" in capsys.readouterr().out


def test_unknown_parts_and_caps_are_refused(session):
    with pytest.raises(SystemExit) as e:
        session.main(["nonsense"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="PART=SECONDS"):
        session.main(["--cap", "bench=soon"])


def test_the_real_parts_fit_what_the_device_brings_back(session, capsys):
    assert len({p.log for p in session.PARTS.values()}) + 1 <= 8  # the parts' files, and session.md
    assert session.main(["--plan"]) == 0
    assert "caps add up to" in capsys.readouterr().out


# What the H200 of 2026-11-26's second session showed (seconds per part from a cold machine), and the order:
# correctness, the op tables, the whole model, dar_latent's decode op, the mechanisms, SFT, the patterns split by
# length, then the tile sweep (the autotuner times the same settings within bench) and what has not changed since.
MEASURED = {"tests": 164, "bench": 216, "mechanisms": 83, "tiles": 102}
ORDER = ["tests", "bench", "model", "darlatent", "mechanisms", "train", "patterns", "patterns32k", "tiles",
         "flexcost", "blocksparse"]


def test_the_plan_is_one_10_minute_call_then_continue(session, capsys):
    """Parts in order of worth; each cap at least 1.3x what the part took on a GPU (1.25x an estimate); the
    first call (--deadline 560) starts the correctness tests, the op and whole-model tables, --continue the
    rest; no demo."""
    assert list(session.PARTS) == ORDER
    for name, part in session.PARTS.items():
        assert (part.expect == MEASURED.get(name, part.expect)
                and part.cap >= (1.3 if name in MEASURED else 1.25) * part.expect)
    argv = [" ".join(cmd) for part in session.PARTS.values() for cmd in part.commands]
    assert not any(" demo " in a for a in argv)
    assert sum("--backend flex" in a for a in argv) == 2 and sum("--backend blocksparse" in a for a in argv) == 2
    assert all("--shape llama-1b" in a for a in argv if "sft_throughput" in a)
    assert session.main(["--plan", "--deadline", "560"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "this call starts tests bench model; --continue runs darlatent mechanisms train patterns" in last
    before = sum(session.PARTS[n].expect for n in ORDER[:3])  # when darlatent would start
    assert before <= 560 < before + session.needs(session.PARTS["darlatent"])


def test_every_command_runs_something_that_is_there(session):
    """Each command names a test file or script of this repository, or an allhere command line its parser
    takes: a typo would cost a lent GPU's minutes."""
    from allhere.cli.main import build_parser

    for name, part in session.PARTS.items():
        for cmd in part.commands:
            args = [a.replace("{tmp}", "/tmp/x") for a in cmd[1:]]
            if args[:2] == ["-m", "allhere.cli"]:
                parsed, extra = build_parser().parse_known_args(args[2:])
                assert not extra, (name, args)
            for a in args:
                if a.startswith(("tests/", "benchmarks/")):
                    assert (ROOT / a).exists(), (name, a)


def test_parts_sharing_a_file_append_to_it(session, tmp_path, monkeypatch):
    monkeypatch.setattr(session, "PARTS", {"a": session.Part(30, "shared.md", (py("print('from a')"),)),
                                           "b": session.Part(30, "shared.md", (py("print('from b')"),))})
    monkeypatch.setattr(session, "versions", lambda: "versions")
    assert session.main(["--out", str(tmp_path), "--state", str(tmp_path / "state.json")]) == 0
    log = (tmp_path / "shared.md").read_text()
    assert "from a\n" in log and "from b\n" in log and log.index("from a") < log.index("from b")
