"""The AA-MoE experiment's tiny preset trains every model and writes its report, json and plots."""

import json

import pytest

from allhere.experiments.aamoe import flops_per_token, plan_for, run_aamoe
from allhere.validation import ConfigError


def test_tiny_experiment_writes_its_report(tmp_path):
    report = run_aamoe(tmp_path / "run", preset="tiny", progress=False)
    run = tmp_path / "run" / "aamoe"
    assert (run / "report.md").exists() and json.loads((run / "report.json").read_text())["preset"] == "tiny"
    rows = report["rows"]
    assert set(rows) == {"dense", "all-attention", "context-only B=2", "experts-only B=2", "AA-MoE B=2"}
    for name, r in rows.items():
        assert r["bpb"] > 0 and r["bpb_4x"] > 0 and r["flops_per_token"] > 0
    lay = rows["AA-MoE B=2"]["layers"][0]
    assert abs(lay["context_share"] + lay["expert_share"] - 1) < 1e-6 and sum(lay["budget_histogram"]) > 0
    assert rows["context-only B=2"]["layers"][0]["expert_share"] == 0
    assert rows["experts-only B=2"]["layers"][0]["context_share"] == 0
    assert rows["AA-MoE B=2"]["flops_budget_double"] > rows["AA-MoE B=2"]["flops_per_token"]
    assert "| dense |" in (run / "report.md").read_text() and len(report["goals"]) == 2
    assert (run / "dense" / "checkpoint.safetensors").exists() and (run / "bpb_vs_flops.png").exists()


def test_plan_checks():
    with pytest.raises(ConfigError, match="preset"):
        plan_for("huge")
    with pytest.raises(ConfigError, match="steps"):
        plan_for("tiny", steps=0)
    with pytest.raises(ConfigError, match="budget"):
        plan_for("tiny", budgets=[-1])
    assert callable(flops_per_token)
