"""SIGTERM to torchrun during FSDP2 training on 2 gloo processes: torchrun forwards it to both workers, which
stop after the same step with a complete sharded checkpoint, which resumes."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from allhere.runtime.model_checkpoint import load_model  # noqa: E402

import dist_train_worker  # noqa: E402


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_the_same_step(tmp_path):
    path = tmp_path / "stopped" / "checkpoint.safetensors"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "dist_train_worker.py"), str(path)]
    proc = subprocess.Popen(cmd + ["0.15"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    latest = path.with_suffix(".dcp") / "latest.json"
    deadline = time.time() + 150
    while not latest.exists():  # the first checkpoint (step 2): both ranks train
        assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before its first checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    stops = {rank: int(step) for rank, step in re.findall(r"\[rank(\d)\]: allhere\.runtime\.interrupt\.Interrupted: "
                                                          r"interrupted at step (\d+) of 20", out)}
    assert stops.keys() == {"0", "1"} and len(set(stops.values())) == 1, out[-3000:]
    step = stops["0"]
    assert json.loads(latest.read_text())["step"] == step < dist_train_worker.CFG.steps
    assert not path.exists()  # no export of an unfinished run

    subprocess.run(cmd + ["0"], env=env, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # resumed from there to the end (exactly so: tests/distributed/test_distributed_train.py)
    _, meta = load_model(path)
    assert [h["step"] for h in meta["history"]] == list(range(1, dist_train_worker.CFG.steps + 1))
