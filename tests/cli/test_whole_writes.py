"""kill -9 while ``allhere convert`` or ``allhere sft`` writes its model: the model folder is absent (or holds
nothing that looks like a model) or whole, a second process on the same --out is refused in one line while the
first one writes, and the same command run again succeeds. An sft killed before its first checkpoint leaves
TensorBoard events that a new run replaces.

The subprocesses are ``allhere`` as its console script runs it, held at one point of the write (``GATED``) for as
long as a gate file exists, so that the kill arrives at a known point without a race."""

import signal

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from gated_process import launch_gated, stop_all  # noqa: E402

from allhere.cli import main  # noqa: E402
from allhere.hf import load_pretrained  # noqa: E402
from allhere.runtime.atomic_folder import partial_path  # noqa: E402
from allhere.runtime.runlock import LOCK_NAME  # noqa: E402

# ``allhere`` held at AT while the file GATE exists, after writing GATE.reached: "weights" (the temporary folder
# holds the weights and config.json, not yet the tokenizer), "written" (every file, before the fsync and rename),
# "published" (just after the rename), "step0" (sft: training's first step, before any checkpoint).
GATED = """
import os, sys, time
from pathlib import Path
gate, at = Path(os.environ["GATE"]), os.environ["AT"]
def wait():
    Path(f"{gate}.reached").write_text(str(os.getpid()))
    while gate.exists():
        time.sleep(0.01)
def before(owner, name):
    real = getattr(owner, name)
    def gated(*a, **k):
        wait()
        return real(*a, **k)
    setattr(owner, name, gated)
import allhere.runtime.atomic_folder as folder
if at == "weights":
    import transformers
    before(transformers.PreTrainedTokenizerBase, "save_pretrained")
elif at == "written":
    before(folder, "fsync_tree")
elif at == "published":
    publish = folder.publish
    folder.publish = lambda *a: (publish(*a), wait())
elif at == "step0":
    import allhere.train
    draw = allhere.train.step_generator
    allhere.train.step_generator = lambda seed, step, micro: (step or micro or wait(), draw(seed, step, micro))[1]
from allhere.cli import main
sys.exit(main())
"""


def convert_args(base, out):
    return ["convert", "--model", str(base / "base"), "--window", "4", "--no-progress", "--out", str(out)]


def sft_args(base, out, report="none"):
    return ["sft", "--model", str(base / "base"), "--data", str(base / "chat.jsonl"), "--window", "4", "--seq-len",
            "16", "--batch-size", "2", "--global-batch", "2", "--max-steps", "2", "--device", "cpu", "--no-progress",
            "--report-to", report, "--out", str(out)]


@pytest.fixture
def start_gated(tmp_path):
    """``start(args, at)``: ``allhere <args>`` started and held at ``at``; returns the process once it waits there.
    Whatever a test leaves running is killed."""
    started = []

    def start(args, at):
        return launch_gated(started, GATED, args, tmp_path / f"gate{len(started)}", {"AT": at}, at)

    yield start
    stop_all(started)


def kill9(proc):
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def looks_like_a_model(folder):
    return folder.exists() and any((folder / f).exists() for f in ("config.json", "model.safetensors"))


def whole(folder):
    """The saved model loads, with its tokenizer and card."""
    assert (folder / "tokenizer.json").is_file() and (folder / "README.md").is_file()
    return load_pretrained(folder)


def test_convert_killed_while_writing_leaves_no_model_and_runs_again(base, tmp_path, start_gated, capsys):
    out = tmp_path / "out"
    proc = start_gated(convert_args(base, out), "weights")
    assert (partial_path(out) / "config.json").is_file() and not looks_like_a_model(out)
    # a second writer of the same --out: one line naming the first, exit 2, nothing changed
    assert main(convert_args(base, out)) == 2
    assert capsys.readouterr().err.strip() == (f"allhere convert: error: {out} is in use by process {proc.pid}, "
                                               "which writes a run there; wait for it to end or stop it (Ctrl-C "
                                               "saves and stops), or choose another folder (nothing was changed)")
    assert (partial_path(out) / "config.json").is_file()
    kill9(proc)
    assert not looks_like_a_model(out) and sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    assert main(convert_args(base, out)) == 0  # the same command again: the killed run's leftovers go
    whole(out)
    assert not partial_path(out).exists() and not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_convert_killed_just_after_the_rename_leaves_the_whole_model(base, tmp_path, start_gated):
    out = tmp_path / "out"
    kill9(start_gated(convert_args(base, out), "published"))
    whole(out)
    assert not looks_like_a_model(partial_path(out))  # the folder the model took the place of (its run lock only)
    assert main(convert_args(base, out)) == 2  # a folder holding a model is refused, not written over
    whole(out)


@pytest.mark.slow
def test_sft_killed_while_writing_its_model_resumes_to_it(base, tmp_path, start_gated):
    out = tmp_path / "run"
    kill9(start_gated(sft_args(base, out), "written"))
    assert not looks_like_a_model(out / "model") and (out / "checkpoint.safetensors").is_file()
    assert main(sft_args(base, out)) == 2  # the run is there: --resume continues it
    assert main([*sft_args(base, out), "--resume"]) == 0
    whole(out / "model")
    assert not partial_path(out / "model").exists()


@pytest.mark.slow
def test_sft_killed_before_its_first_checkpoint_runs_again(base, tmp_path, start_gated):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    kill9(start_gated(sft_args(base, out, "tensorboard"), "step0"))
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, "tensorboard"]
    assert_runs_again(base, tmp_path, out)


def test_sft_stopped_before_its_first_checkpoint_runs_again(base, tmp_path, monkeypatch):
    """As the test above, in this process: the run fails in its first step, where a kill -9 would stop it."""
    pytest.importorskip("tensorboard")
    import allhere.train

    def failing(seed, step, micro):
        raise RuntimeError("stopped")

    out = tmp_path / "run"
    with monkeypatch.context() as patched:
        patched.setattr(allhere.train, "step_generator", failing)
        with pytest.raises(RuntimeError, match="stopped"):
            main(sft_args(base, out, "tensorboard"))
    assert sorted(p.name for p in out.iterdir()) == ["tensorboard"]
    assert_runs_again(base, tmp_path, out)


def assert_runs_again(base, tmp_path, out):
    left = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert left and all(n.startswith("events.out.tfevents.") for n in left)
    assert main([*sft_args(base, out, "tensorboard"), "--resume"]) == 2  # no run to continue
    assert main(sft_args(base, out, "tensorboard")) == 0  # without --resume: a new run, the old events replaced
    now = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert len(now) == 1 and now[0] not in left
    whole(out / "model")
    # a folder that holds anything else is still refused
    (out / "model").rename(tmp_path / "moved")
    (out / "checkpoint.safetensors").rename(tmp_path / "ckpt")
    (out / "checkpoint.json").unlink(missing_ok=True)
    (out / "notes.txt").write_text("mine")
    assert main(sft_args(base, out, "tensorboard")) == 2
    assert (out / "notes.txt").read_text() == "mine" and (out / "tensorboard" / now[0]).is_file()
