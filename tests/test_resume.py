import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from allhere.checkpoint import load_model

HERE = Path(__file__).parent
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
