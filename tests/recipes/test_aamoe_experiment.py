"""The AA-MoE experiment's tiny preset trains every model and writes its report, json and plots."""

import json

import pytest

from allhere.validation import ConfigError
from allhere_recipes.aamoe import flops_per_token, mixed_task, plan_for, run_aamoe


def test_tiny_experiment_writes_its_report(tmp_path):
    report = run_aamoe(tmp_path / "run", preset="tiny", progress=False, seeds=(0,))
    run = tmp_path / "run" / "aamoe"
    assert (run / "report.md").exists() and json.loads((run / "report.json").read_text())["preset"] == "tiny"
    rows = report["rows"]
    assert set(rows) == {"dense", "all-attention", "context-only B=2", "experts-only B=2", "AA-MoE B=2"}
    for name, r in rows.items():
        assert r["bpb"]["mean"] > 0 and r["bpb_4x"]["mean"] > 0 and r["flops_per_token"]["mean"] > 0
        assert r["bpb"]["n"] == 1 and r["bpb"]["std"] is None and r["seeds"] == [0]
    lay = rows["AA-MoE B=2"]["layers"][0]
    assert abs(lay["context_share"]["mean"] + lay["expert_share"]["mean"] - 1) < 1e-6
    assert sum(lay["budget_histogram"]) > 0
    assert rows["context-only B=2"]["layers"][0]["expert_share"]["mean"] == 0
    assert rows["experts-only B=2"]["layers"][0]["context_share"]["mean"] == 0
    r = rows["AA-MoE B=2"]
    assert r["flops_budget_double"]["mean"] > r["flops_per_token"]["mean"]
    text = (run / "report.md").read_text()
    assert "| dense |" in text and len(report["goals"]) == 2 and "Verdict on this task" in text
    assert report["missing"] == [] and "needs >= 3 seeds" in text
    assert (run / "dense" / "seed0" / "checkpoint.safetensors").exists() and (run / "bpb_vs_flops.png").exists()


def test_mixed_task_reports_accuracy_per_kind(tmp_path):
    report = run_aamoe(tmp_path / "run", preset="tiny", progress=False, seeds=(0, 1), task="mixed",
                       wanted=["dense", "experts-only"])
    rows = report["rows"]
    assert set(rows) == {"dense", "experts-only B=2"}
    for r in rows.values():
        for key in ("acc_table", "acc_context", "acc_table_4x", "acc_context_2x"):
            assert 0 <= r[key]["mean"] <= 1 and r[key]["n"] == 2 and r[key]["std"] is not None
    assert "acc_table_budget_half" in rows["experts-only B=2"]
    text = (tmp_path / "run" / "aamoe" / "report.md").read_text()
    assert "table (a)" in text and "mixed recall task" in text and (tmp_path / "run/aamoe/accuracy.png").exists()
    curves = report["curves"]["dense"]  # one batch's bits/byte at each logged step, per seed, from the history
    assert set(curves) == {"0", "1"} and [step for step, _ in curves["0"]] == [1, 2, 3]
    assert curves["0"] != curves["1"] and all(b > 0 for _, b in curves["1"])
    assert (tmp_path / "run/aamoe/learning_curves.png").exists()


def test_plan_checks():
    with pytest.raises(ConfigError, match="preset"):
        plan_for("huge")
    with pytest.raises(ConfigError, match="steps"):
        plan_for("tiny", steps=0)
    with pytest.raises(ConfigError, match="budget"):
        plan_for("tiny", budgets=[-1])
    assert plan_for("cpu-long").steps == 10000 and callable(flops_per_token)
    for preset in ("tiny", "cpu", "cpu-long"):  # the mixed task fits every preset, pairs asked >= 2 chunks on
        plan = plan_for(preset)
        assert mixed_task(plan).min_gap >= 2 * plan.chunk
    assert mixed_task(plan_for("cpu")).min_gap == 32
