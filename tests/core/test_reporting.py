"""TensorBoard reports of training runs (``allhere.runtime.reporting``), read back with TensorBoard's own reader: every
curve and the mu_f heatmap; a stopped and resumed run has each step once; ``none`` writes nothing; the
command line's --report-to, its line on stderr, and one error line without the package."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from allhere import AHAConfig, Decoder, ModelConfig
from allhere.config import TrainConfig
from allhere.eval import evaluate_lm
from allhere.runtime.reporting import HELDOUT_SUFFIX, default_report_to, events_dir, report_heldout, report_to
from allhere.train import train

from tb_events import events, scalars

ROOT = Path(__file__).resolve().parents[2]
TRAIN_TAGS = {f"train/{t}" for t in ("loss", "lm_loss", "mu_f", "lambda", "lr", "tokens_per_s")}
HELD_OUT = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))


def tiny_model():
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                               mechanism=AHAConfig(window=4, lam=0.01, router_init="neutral")))


def batches(step, micro, g):
    return torch.randint(0, 50, (2, 16), generator=g)


def held_out(model):
    return evaluate_lm(model, HELD_OUT)  # loss, bits_per_token, mu_f and usage [layers][heads]


def cfg(steps=4, **kw):
    return TrainConfig(steps=steps, batch_size=2, grad_accum=2, lr=3e-3, log_every=1, **kw)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one thread (tests/conftest.py)."""


def steps(acc, tag):
    return [e.step for e in acc.Scalars(tag)]


def test_a_run_writes_every_curve_and_the_heatmap(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    path = tmp_path / "run" / "checkpoint.safetensors"
    state = train(tiny_model(), batches, cfg(eval_every=2), path, eval_fn=held_out, progress=False,
                  report_to="tensorboard")
    acc = events(tmp_path / "run" / "tensorboard")
    tags = acc.Tags()
    assert TRAIN_TAGS <= set(tags["scalars"])
    for tag in TRAIN_TAGS:
        assert steps(acc, tag) == [1, 2, 3, 4], tag
    for row, loss, lm, mu_f in zip(state["history"], *(acc.Scalars(f"train/{t}") for t in ("loss", "lm_loss", "mu_f"))):
        assert (loss.value, lm.value, mu_f.value) == pytest.approx((row["loss"], row["lm"], row["mu_f"]), abs=1e-4)
    assert [e.value for e in acc.Scalars("train/lambda")] == pytest.approx([0.01] * 4)
    assert all(e.value > 0 for e in acc.Scalars("train/tokens_per_s"))
    for name in ("loss", "bits_per_token", "mu_f"):  # the held-out numbers at each evaluation
        assert [(e.step, pytest.approx(e.value, abs=1e-5)) for e in acc.Scalars(f"eval/{name}")] == \
            [(r["step"], r[name]) for r in state["evals"]]
    assert tags["images"] == ["eval/mu_f_heatmap"]
    assert [(i.step, i.encoded_image_string[:4]) for i in acc.Images("eval/mu_f_heatmap")] == \
        [(2, b"\x89PNG"), (4, b"\x89PNG")]
    assert all("usage" not in e for e in state["evals"])  # drawn, not kept in the checkpoint


def test_a_stopped_run_resumed_has_each_step_once(tmp_path):
    """Stopped at step 6 with its last checkpoint at step 4: the resumed run writes 5 and 6 again, and the reader
    keeps only those (``purge_step``); every curve has steps 1..8 once, the resumed run's values."""
    pytest.importorskip("tensorboard")
    path = tmp_path / "run" / "checkpoint.safetensors"

    def crashing(step, micro, g):
        if step == 6:
            raise RuntimeError("the machine went away")
        return batches(step, micro, g)

    with pytest.raises(RuntimeError):
        train(tiny_model(), crashing, cfg(8, ckpt_every=4), path, progress=False, report_to="tensorboard")
    first = events(events_dir(path))
    assert steps(first, "train/loss") == [1, 2, 3, 4, 5, 6]  # steps 5, 6 are beyond the checkpoint
    state = train(tiny_model(), batches, cfg(8, ckpt_every=4), path, resume=True, progress=False,
                  report_to="tensorboard")
    assert len(list(events_dir(path).glob("events.out.tfevents.*"))) == 2
    acc = events(events_dir(path))
    for tag in TRAIN_TAGS:
        assert steps(acc, tag) == list(range(1, 9)), tag
    assert [e.value for e in acc.Scalars("train/lm_loss")] == pytest.approx([r["lm"] for r in state["history"]],
                                                                            abs=1e-4)


def test_a_jobs_heldout_numbers_join_a_finished_runs_events_once(tmp_path):
    """``report_heldout`` after the run: the numbers and the heatmap under heldout/ at the run's last step, the
    training curves kept; measured again (a rerun of the job), the new numbers replace the old ones."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "run" / "checkpoint.safetensors"
    model = tiny_model()
    train(model, batches, cfg(), path, progress=False, report_to="tensorboard")
    first, again = held_out(model), {**held_out(model), "loss": 9.5}
    report_heldout(path, 4, first, model, report="tensorboard")
    report_heldout(path, 4, again, model, report="tensorboard")
    acc = events(events_dir(path))
    assert steps(acc, "train/loss") == [1, 2, 3, 4]
    assert scalars(acc, "heldout/loss") == [(4, 9.5)]
    assert scalars(acc, "heldout/mu_f") == [(4, pytest.approx(first["mu_f"]))]
    assert acc.Tags()["images"] == ["heldout/mu_f_heatmap"] and len(acc.Images("heldout/mu_f_heatmap")) == 1
    assert len(list(events_dir(path).glob("*" + HELDOUT_SUFFIX))) == 1
    with report_to("none"):
        report_heldout(tmp_path / "quiet" / "checkpoint.safetensors", 4, first, model)
    assert not (tmp_path / "quiet").exists()


def test_heldout_numbers_stay_when_their_file_would_sort_before_the_runs(tmp_path):
    """A run's events file whose name sorts after the held-out file's (opened in the same second by a writer with a
    counter of more digits, or by a later process): the held-out file is renamed to sort last, and TensorBoard's
    reader, which reads a folder's files in name order, keeps its numbers."""
    path = tmp_path / "run" / "checkpoint.safetensors"
    model = tiny_model()
    train(model, batches, cfg(), path, progress=False, report_to="tensorboard")
    logdir = events_dir(path)
    (own,) = logdir.glob("events.out.tfevents.*")
    later = own.with_name("events.out.tfevents.9999999990" + own.name[len("events.out.tfevents.") + 10:])
    own.rename(later)  # the run's file now sorts after anything opened today
    report_heldout(path, 4, {"loss": 1.25}, model, report="tensorboard")
    (held,) = logdir.glob("*" + HELDOUT_SUFFIX)
    assert held.name > later.name and held.name.startswith("events.out.tfevents.9999999991.")
    acc = events(logdir)
    assert scalars(acc, "heldout/loss") == [(4, 1.25)] and steps(acc, "train/loss") == [1, 2, 3, 4]


def test_none_writes_nothing_and_a_block_chooses_for_every_run(tmp_path):
    pytest.importorskip("tensorboard")
    train(tiny_model(), batches, cfg(2), tmp_path / "default" / "checkpoint.safetensors", progress=False)
    train(tiny_model(), batches, cfg(2), tmp_path / "none" / "checkpoint.safetensors", progress=False,
          report_to="none")
    with report_to("none"):
        train(tiny_model(), batches, cfg(2), tmp_path / "block" / "checkpoint.safetensors", progress=False)
    assert not list(tmp_path.rglob("tensorboard")) and not list(tmp_path.rglob("events.out.tfevents.*"))

    said = []
    with report_to("tensorboard", root=tmp_path / "job", say=said.append):  # DAR's two stages in one folder
        for stage in ("stage1", "stage2"):
            train(tiny_model(), batches, cfg(2), tmp_path / "job" / f"{stage}.safetensors", progress=False)
    for stage in ("stage1", "stage2"):
        assert steps(events(tmp_path / "job" / "tensorboard" / stage), "train/loss") == [1, 2]
    assert said == [f"TensorBoard: training curves in {tmp_path / 'job' / 'tensorboard' / 'stage1'} (each training "
                    "run in its folder's tensorboard/); see them with: tensorboard --logdir " + str(tmp_path / "job")]


def test_without_matplotlib_the_heatmap_is_skipped_with_a_note(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    said = []
    with report_to("tensorboard", say=said.append):
        train(tiny_model(), batches, cfg(4, eval_every=2), tmp_path / "r" / "checkpoint.safetensors",
              eval_fn=held_out, progress=False)
    acc = events(tmp_path / "r" / "tensorboard")
    assert acc.Tags()["images"] == [] and steps(acc, "eval/mu_f") == [2, 4]
    assert said[1:] == ["TensorBoard: no mu_f heatmap images (plots need matplotlib: pip install 'allhere[plot]')"]


# the writer's own thread ends with the error it then hands to the training loop's next call
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_events_that_cannot_be_written_never_end_the_run(tmp_path):
    """The events' folder removed mid-run: one line says the events stopped, the run trains to its last step."""
    import shutil

    pytest.importorskip("tensorboard")
    said, run = [], tmp_path / "r"

    def held_out_then_gone(model):
        shutil.rmtree(run / "tensorboard", ignore_errors=True)
        return held_out(model)

    with report_to("tensorboard", say=said.append):
        state = train(tiny_model(), batches, cfg(6, eval_every=2, ckpt_every=2), run / "checkpoint.safetensors",
                      eval_fn=held_out_then_gone, progress=False)
    assert state["step"] == 6 and [e["step"] for e in state["evals"]] == [2, 4, 6]
    assert len(said) == 2 and said[1].startswith("TensorBoard: events no longer written ("), said
    assert said[1].endswith("the training run goes on")


def test_without_tensorboard_one_clear_error(tmp_path, monkeypatch, capsys):
    from allhere.cli import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    out = tmp_path / "demo"
    assert main(["demo", "--preset", "tiny", "--out", str(out), "--report-to", "tensorboard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["allhere demo: error: argument --report-to: 'tensorboard' needs the tensorboard package: "
                   "pip install 'allhere[tensorboard]' (or --report-to none)"]
    assert not out.exists()
    assert default_report_to() == "none"  # the command line's default without the package
    with pytest.raises(ImportError, match=r"pip install 'allhere\[tensorboard\]'"):
        train(tiny_model(), batches, cfg(2), tmp_path / "r" / "checkpoint.safetensors", progress=False,
              report_to="tensorboard")
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").iterdir())


def test_sft_on_the_command_line(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("transformers")
    from allhere.cli import main

    from hf_fixtures import write_chat, write_model

    model, chat = write_model("Llama-3.2-1B", tmp_path / "base"), write_chat(tmp_path / "chat.jsonl")
    args = ["sft", "--model", str(model), "--data", str(chat), "--window", "4", "--seq-len", "16", "--batch-size",
            "2", "--global-batch", "2", "--max-steps", "2", "--device", "cpu", "--no-progress"]
    out = tmp_path / "sft"
    assert main(args + ["--out", str(out)]) == 0  # the default: tensorboard, where it is installed
    err = capsys.readouterr().err
    assert f"TensorBoard: training curves in {out / 'tensorboard'}" in err
    assert err.count("TensorBoard:") == 1 and f"tensorboard --logdir {out}\n" in err
    assert TRAIN_TAGS <= set(events(out / "tensorboard").Tags()["scalars"])
    assert main(args + ["--out", str(tmp_path / "quiet"), "--report-to", "none"]) == 0
    assert "TensorBoard" not in capsys.readouterr().err and not (tmp_path / "quiet" / "tensorboard").exists()


def test_import_allhere_does_not_import_tensorboard():
    code = ("import sys, allhere, allhere.train, allhere.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorboard' or 'tensorboard' in m))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
