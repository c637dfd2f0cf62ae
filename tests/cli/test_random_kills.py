"""kill -9 at random moments, 20 times each, of ``allhere convert``, ``allhere sft`` (training and its final save)
and a GGUF file's folder copy (``allhere.hf.gguf.as_folder``, what ``allhere serve`` writes for a GGUF): after
each kill the model folder holds nothing that looks like a model, or loads and equals a clean run's to the last
bit; the same command run again then ends with the clean run's model.

Each run is a fork of this process (its imports done), killed after a random share of the time a whole run takes
(measured first, the same way): the kills land all over a run, its writes included, with no gate to aim them
(``test_whole_writes.py`` holds runs at chosen points of the write instead). ``convert`` and ``sft`` are also
killed as fresh processes, 6 times each: a user's own command, its start-up included."""

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from allhere.cli import main  # noqa: E402

KILLS = 20
FRESH_KILLS = 6  # fresh processes killed, for the commands tried that way (each pays its start-up)
# the runs finished in this process compute as the forked ones do (one thread: tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def forked(fn) -> int:
    """``fn()`` in a child process (one thread); its return value the child's exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            torch.set_num_threads(1)
            code = fn()
        finally:
            os._exit(code if isinstance(code, int) else 0)
    return pid


def whole_run(fn, limit: float = 300.0) -> float:
    """Seconds a whole forked run of ``fn`` takes (it must succeed)."""
    start = time.monotonic()
    pid = forked(fn)
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() - start > limit:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"a run took more than {limit} s")
        time.sleep(0.002)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    return time.monotonic() - start


def kill_at_random(fn, seconds: float, rng: random.Random) -> None:
    pid = forked(fn)
    time.sleep(rng.uniform(0.0, seconds))
    os.kill(pid, signal.SIGKILL)  # a run that has ended already is a zombie until reaped: no error
    os.waitpid(pid, 0)


def looks_like_a_model(folder: Path) -> bool:
    return folder.exists() and any((folder / f).exists() for f in ("config.json", "model.safetensors"))


def same_weights(folder: Path, clean: Path) -> None:
    from safetensors.torch import load_file

    assert (folder / "config.json").read_text() == (clean / "config.json").read_text()
    assert (folder / "tokenizer.json").is_file()
    ours, theirs = load_file(folder / "model.safetensors"), load_file(clean / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_convert_killed_at_random(base, tmp_path):
    args = lambda out: ["convert", "--model", str(base / "base"), "--window", "4", "--no-progress",  # noqa: E731
                        "--out", str(out)]
    seconds = whole_run(lambda: main(args(tmp_path / "clean")))
    rng, landed = random.Random(0), 0
    for i in range(KILLS):
        out = tmp_path / f"out{i}"
        kill_at_random(lambda: main(args(out)), seconds, rng)
        if looks_like_a_model(out):  # killed after the rename: whole
            landed += 1
        else:
            assert main(args(out)) == 0  # the killed run's leftovers give way
        same_weights(out, tmp_path / "clean")
    assert landed < KILLS  # the kills did not all come after the runs had ended


def sft_args(base: Path, out: Path, *more) -> list[str]:
    return ["sft", "--model", str(base / "base"), "--data", str(base / "chat.jsonl"), "--window", "4",
            "--seq-len", "16", "--batch-size", "2", "--global-batch", "2", "--max-steps", "2", "--device", "cpu",
            "--no-progress", "--report-to", "none", "--out", str(out), *more]


def test_sft_killed_at_random(base, tmp_path):
    args = lambda out, *more: sft_args(base, out, *more)  # noqa: E731

    seconds = whole_run(lambda: main(args(tmp_path / "clean")))
    rng, landed = random.Random(1), 0
    for i in range(KILLS):
        out = tmp_path / f"run{i}"
        kill_at_random(lambda: main(args(out)), seconds, rng)
        if looks_like_a_model(out / "model"):
            landed += 1
        elif main(args(out)) == 2:  # a checkpoint is there: --resume continues it (one line said so)
            assert main(args(out, "--resume")) == 0
        same_weights(out / "model", tmp_path / "clean" / "model")
    assert landed < KILLS


def test_gguf_copy_killed_at_random(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from allhere.hf.gguf import as_folder

    from gguf_fixture import tiny_llama, write_gguf

    tok, model = tiny_llama()
    path = write_gguf(tmp_path / "tiny.gguf", tok, model)
    monkeypatch.setenv("ALLHERE_CACHE", str(tmp_path / "clean-cache"))
    seconds = whole_run(lambda: as_folder(path) and 0)
    clean = as_folder(path)  # the copy the clean run wrote
    rng, landed = random.Random(2), 0
    for i in range(KILLS):
        monkeypatch.setenv("ALLHERE_CACHE", str(tmp_path / f"cache{i}"))
        kill_at_random(lambda: as_folder(path) and 0, seconds, rng)
        copy = tmp_path / f"cache{i}" / "gguf-folders" / clean.name  # the name a lookup reads (a partial sibling
        if looks_like_a_model(copy):  # of a killed writer has another): absent or whole
            landed += 1
            same_weights(copy, clean)
        same_weights(as_folder(path), clean)
    assert landed < KILLS


def fresh_kills(command: str, args, model_of, recover, clean: Path, tmp_path: Path, seed: int) -> None:
    """``FRESH_KILLS`` runs of ``python -m allhere.cli <command> <args(out)>``, each a fresh process (its own
    imports and start-up, as a user's shell runs it) killed at a random moment after its imports: between the time
    ``<command> --help`` takes and a whole run's. After each kill ``model_of(out)`` holds nothing that looks like a
    model or is whole; ``recover(run, out)`` (``run(*more)``: the command again, its exit code) then ends the work,
    and the model equals ``clean``'s (a whole run's, written here first)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(*more):
        return subprocess.Popen([sys.executable, "-m", "allhere.cli", command, *more], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def timed(*more) -> float:
        t0 = time.monotonic()
        assert start(*more).wait(timeout=300) == 0
        return time.monotonic() - t0

    started, whole = timed("--help"), timed(*args(clean))
    print(f"{command}: start-up {started:.2f} s, whole run {whole:.2f} s")
    rng, landed = random.Random(seed), 0
    for i in range(FRESH_KILLS):
        out = tmp_path / f"fresh{i}"
        proc = start(*args(out))
        time.sleep(rng.uniform(started, max(started, whole)))
        proc.kill()  # a run that has ended already is a zombie until waited for: no error
        proc.wait()
        if looks_like_a_model(model_of(out)):
            landed += 1
        else:
            recover(lambda *more: start(*args(out), *more).wait(timeout=300), out)
        same_weights(model_of(out), model_of(clean))
    assert landed < FRESH_KILLS


def test_convert_process_killed_at_random(base, tmp_path):
    def recover(run, out):
        assert run() == 0  # a fresh run past the killed one's leftovers

    fresh_kills("convert", lambda out: ["--model", str(base / "base"), "--window", "4", "--no-progress",
                                        "--out", str(out)],
                lambda out: out, recover, tmp_path / "clean", tmp_path, seed=3)


def test_sft_process_killed_at_random(base, tmp_path):
    def recover(run, out):
        if run() == 2:  # a checkpoint is there: --resume continues it (one line said so)
            assert run("--resume") == 0

    fresh_kills("sft", lambda out: sft_args(base, out)[1:], lambda out: out / "model", recover, tmp_path / "clean",
                tmp_path, seed=4)
