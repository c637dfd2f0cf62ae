"""The AA-MoE grid: a (model, seed) run folder each, subsets of models and seeds in several sittings,
interrupted runs resumed, the report aggregating what has finished and naming what has not; the flags."""

import signal

import pytest

from allhere.cli import main
from allhere.runtime.interrupt import Interrupted
from allhere.validation import ConfigError
from allhere_recipes import aamoe
from allhere_recipes.aamoe_grid import check_seeds, compare, select_models, stat

NAMES = ["dense", "all-attention", "context-only B=2", "experts-only B=2", "AA-MoE B=1", "AA-MoE B=2"]


def test_model_names_keys_and_seeds():
    assert select_models(NAMES, None) == NAMES
    assert select_models(NAMES, ["AA-MoE B=2", "dense", "Context-Only"]) == ["dense", "context-only B=2", "AA-MoE B=2"]
    assert select_models(NAMES, ["aamoe"]) == ["AA-MoE B=1", "AA-MoE B=2"]
    assert select_models(NAMES, ["aamoe-1", "experts-only_B2"]) == ["experts-only B=2", "AA-MoE B=1"]
    with pytest.raises(ConfigError, match="--models 'aamoe-4' is not a model"):
        select_models(NAMES, ["aamoe-4"])
    assert check_seeds([2, 0, 2]) == (2, 0)
    for bad in ([], [-1], [1.5]):
        with pytest.raises(ConfigError, match="--seeds"):
            check_seeds(bad)


def test_stats_and_comparisons():
    s = stat([1.0, 2.0, 3.0])
    assert s["mean"] == 2.0 and abs(s["std"] - 1.0) < 1e-12 and s["n"] == 3
    ref, other = stat([1.0, 1.1, 0.9]), stat([2.0, 2.1, 1.9])
    assert compare(ref, other, "x") == {"verdict": "undecided", "why": "not measured"}
    assert compare({"x": ref}, {"x": other}, "x")["verdict"] == "better"
    assert compare({"x": other}, {"x": ref}, "x")["verdict"] == "worse"
    assert compare({"x": ref}, {"x": stat([1.1, 1.2, 0.8])}, "x")["verdict"] == "undecided"
    assert "seeds" in compare({"x": stat([1.0, 1.0])}, {"x": stat([5.0, 5.0])}, "x")["why"]


def interrupting(after: int):
    """task_data whose batches send SIGINT once ``after`` batches were drawn (a Ctrl-C mid-run)."""
    real, drawn = aamoe.task_data, [0]

    def task_data(task, plan):
        data = real(task, plan)
        inner = data["batches"]

        def batches(step, micro, g):
            drawn[0] += 1
            if drawn[0] == after:
                signal.raise_signal(signal.SIGINT)
            return inner(step, micro, g)

        return dict(data, batches=batches)

    return task_data


def test_sittings_interruptions_and_partial_grids(tmp_path, monkeypatch):
    out = tmp_path / "grid"
    run = out / "aamoe"
    first = aamoe.run_aamoe(out, "tiny", progress=False, steps=4, wanted=["dense"], seeds=(0, 1))
    assert set(first["rows"]) == {"dense"} and first["rows"]["dense"]["bpb"]["n"] == 2
    assert {(m["model"], m["seed"], m["state"]) for m in first["missing"]} == {
        (n, s, "missing") for n in ("all-attention", "context-only B=2", "experts-only B=2", "AA-MoE B=2")
        for s in (0, 1)}
    assert "- AA-MoE B=2, seed 1: missing" in (run / "report.md").read_text()

    with monkeypatch.context() as m:  # Ctrl-C during the second step of AA-MoE seed 0
        m.setattr(aamoe, "task_data", interrupting(after=2))
        with pytest.raises(Interrupted):
            aamoe.run_aamoe(out, "tiny", progress=False, steps=4, wanted=["aamoe"], seeds=(0,))
    report = aamoe.run_aamoe(out, "tiny", progress=False, steps=4, seeds=(2,), train_runs=False)
    assert report["seeds"] == [0, 1, 2] and set(report["rows"]) == {"dense"}
    partial = [m for m in report["missing"] if m["model"] == "AA-MoE B=2" and m["seed"] == 0]
    assert partial == [{"model": "AA-MoE B=2", "seed": 0, "state": "partial", "step": 2}]
    assert "AA-MoE B=2, seed 0: partial (2 steps done)" in (run / "report.md").read_text()

    before = (run / "dense" / "seed0" / "eval.json").stat().st_mtime_ns
    done = aamoe.run_aamoe(out, "tiny", progress=False, steps=4, wanted=["AA-MoE B=2"], seeds=(0,))
    assert done["rows"]["AA-MoE B=2"]["seeds"] == [0]  # resumed from step 2 and finished
    assert (run / "dense" / "seed0" / "eval.json").stat().st_mtime_ns == before  # finished runs are not re-measured
    assert done["rows"]["dense"]["bpb"]["mean"] == first["rows"]["dense"]["bpb"]["mean"]
    (run / "dense" / "seed1" / "eval.json").unlink()  # finished but never measured: measured from its checkpoint
    again = aamoe.run_aamoe(out, "tiny", progress=False, steps=4, seeds=(0,), train_runs=False)
    assert again["runs"]["dense"]["1"] == first["runs"]["dense"]["1"]
    assert (run / "dense" / "seed1" / "eval.json").exists()
    with pytest.raises(ConfigError, match="other settings"):  # the folder belongs to its plan and task
        aamoe.run_aamoe(out, "tiny", progress=False, steps=4, task="mixed", wanted=["dense"], seeds=(0,))


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("allhere aamoe: error: "), err
    return err[0]


def test_cli_flags(tmp_path, capsys):
    out = tmp_path / "cli"
    base = ["aamoe", "--preset", "tiny", "--out", str(out), "--no-progress"]
    for flags, needle in ((["--models", "nope"], "--models 'nope'"), (["--seeds", "-1"], "--seeds"),
                          (["--seeds", "x"], "--seeds"), (["--task", "poems"], "--task"),
                          (["--preset", "huge"], "--preset"), (["--models", " "], "--models")):
        assert main(base + flags) == 2, flags
        assert needle in one_line(capsys)
    assert not out.exists()  # nothing claimed by a refused command
    assert main(base + ["--models", "dense", "aamoe-2", "--seeds", "3", "--task", "mixed"]) == 0
    assert (out / "aamoe" / "AA-MoE_B2" / "seed3" / "eval.json").exists()
    capsys.readouterr()
    assert main(base + ["--task", "mixed", "--report-only", "--seeds", "4"]) == 0
    text = capsys.readouterr().out
    assert "| dense | 1 |" in text and "- dense, seed 4: missing" in text
    assert not (out / "aamoe" / "dense" / "seed4").exists()


def test_every_aamoe_option_is_typed_and_says_its_default():
    """What tests/cli/test_cli_input.py asks of every option, for this command's new flags."""
    import argparse

    from allhere.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["aamoe"]
    known = {"text", "integer>=0", "integer>=1", "number>0", "device", "output folder"}
    for action in sub._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert "default" in (action.help or ""), action.option_strings
        if not isinstance(action, argparse._StoreTrueAction) and action.choices is None:
            assert action.type is not None and action.type.__name__ in known, action.option_strings
