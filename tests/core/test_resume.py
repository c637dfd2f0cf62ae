import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from allhere.runtime.model_checkpoint import CheckpointError, load_model

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import train_worker  # noqa: E402


def test_killed_training_resumes_exactly(tmp_path):
    path = tmp_path / "killed" / "checkpoint.safetensors"
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(HERE / "train_worker.py"), str(path), "0.05"], env=env)
    killed_at = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        sidecar = path.with_suffix(".json")
        try:
            step = json.loads(sidecar.read_text())["step"]
        except (OSError, ValueError, KeyError):
            step = 0
        if step >= 8:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed_at = step
            break
        time.sleep(0.02)
    assert killed_at is not None, "the worker finished or stalled before it could be killed"
    assert json.loads(path.with_suffix(".json").read_text())["step"] < train_worker.CFG.steps

    resumed = train_worker.run(path)
    straight = train_worker.run(tmp_path / "straight" / "checkpoint.safetensors")
    assert resumed["step"] == straight["step"] == train_worker.CFG.steps
    assert resumed["history"] == straight["history"]
    a, _ = load_model(path)
    b, _ = load_model(tmp_path / "straight" / "checkpoint.safetensors")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_runs_of_an_earlier_version_resume(tmp_path):
    """Settings and checkpoints written before a TrainConfig field existed (here: without target_mu_f and
    lam_rate) are the same settings when that field is at its default; another value is refused."""
    from allhere.config import TrainConfig
    from allhere.train import check_settings
    from allhere.validation import ConfigError
    from allhere_recipes.plans import plan_from_dict, plans, run_settings
    from allhere_recipes.rundir import claim

    plan = plans("tiny")["recall"]
    old = run_settings(plan, None)
    for stage in ("pretrain", "finetune"):
        del old["plan"][stage]["target_mu_f"], old["plan"][stage]["lam_rate"]
    (tmp_path / "settings.json").write_text(json.dumps(old))
    upgrade = lambda saved: run_settings(plan_from_dict(saved["plan"]), saved["data_path"])  # noqa: E731
    claim(tmp_path, run_settings(plan, None), upgrade)
    with pytest.raises(ConfigError, match="other settings"):
        claim(tmp_path, run_settings(plan, "other.txt"), upgrade)

    cfg = TrainConfig(steps=3)
    meta = {"train_config": {k: v for k, v in cfg.to_dict().items() if k not in ("target_mu_f", "lam_rate")}}
    check_settings(meta, cfg, None, tmp_path / "c.safetensors")
    for other in (TrainConfig(steps=3, target_mu_f=0.1), TrainConfig(steps=4)):
        with pytest.raises(CheckpointError, match="other training settings"):
            check_settings(meta, other, None, tmp_path / "c.safetensors")
    for meta in ({"train_config": {**cfg.to_dict(), "from_the_future": 1}}, {}):  # an unknown field; none at all
        with pytest.raises(CheckpointError, match="other training settings"):
            check_settings(meta, cfg, None, tmp_path / "c")
