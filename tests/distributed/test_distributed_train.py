"""FSDP2 data-parallel training on 2 gloo processes: the same losses and weights as one process at the
same global batch; a run with one process killed resumes from its sharded checkpoint exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from allhere.runtime.model_checkpoint import load_model  # noqa: E402

import dist_train_worker  # noqa: E402
import dist_worker  # noqa: E402
import train_worker  # noqa: E402

CFG = dist_train_worker.CFG


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    path = tmp / "straight" / "checkpoint.safetensors"
    per_rank = dist_worker.launch(dist_train_worker.spawned, 2, tmp / "results", path)
    return path, per_rank


@pytest.mark.slow
def test_two_processes_match_one(two_process_run, tmp_path):
    path, per_rank = two_process_run
    single = dist_train_worker.run(tmp_path / "single" / "checkpoint.safetensors")
    assert per_rank[0]["history"] == per_rank[1]["history"]
    two = per_rank[0]["history"]
    assert [h["step"] for h in two] == [h["step"] for h in single["history"]] == list(range(1, CFG.steps + 1))
    for a, b in zip(two, single["history"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a, b)
        assert abs(a["mu_f"] - b["mu_f"]) <= 1e-4, (a, b)
    exported, meta = load_model(path)  # the export is an ordinary checkpoint
    assert meta["step"] == CFG.steps
    one, _ = load_model(tmp_path / "single" / "checkpoint.safetensors")
    init = train_worker.fresh_model()
    for (name, p), q, p0 in zip(exported.named_parameters(), one.parameters(), init.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
        assert not torch.equal(p, p0), f"{name} never changed"


@pytest.mark.slow
def test_killed_rank_resumes_from_sharded_checkpoint(two_process_run, tmp_path):
    straight, _ = two_process_run
    path = tmp_path / "killed" / "checkpoint.safetensors"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "dist_train_worker.py"), str(path)]
    proc = subprocess.Popen(cmd + ["0.15"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = path.with_suffix(".dcp") / "latest.json"
    killed_at, deadline = None, time.time() + 150
    while time.time() < deadline and proc.poll() is None:
        try:
            step = json.loads(latest.read_text())["step"]
        except (OSError, ValueError, KeyError):
            step = 0
        if step >= 6:
            os.kill(int((path.parent / "pids" / "rank1").read_text()), signal.SIGKILL)
            killed_at = step
            break
        time.sleep(0.02)
    proc.wait(timeout=120)
    assert killed_at is not None, "the run finished or stalled before a rank could be killed"
    assert proc.returncode != 0  # torchrun saw its worker die
    assert json.loads(latest.read_text())["step"] < CFG.steps
    assert not path.exists()  # no export of an unfinished run

    subprocess.run(cmd + ["0"], env=env, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    resumed, meta = load_model(path)
    reference, ref_meta = load_model(straight)
    assert meta["step"] == ref_meta["step"] == CFG.steps
    assert meta["history"] == ref_meta["history"]
    for (name, p), q in zip(resumed.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_aamoe_predictor_trains_alike_in_two_processes(tmp_path):
    """FSDP2 and a mechanism's aux_loss: AA-MoE's budget predictor gets its gradient only from that loss,
    not through the block's output; two processes train it (and everything else) as one does."""
    cfg = dist_train_worker.AAMOE_CFG
    path = tmp_path / "two" / "checkpoint.safetensors"
    per_rank = dist_worker.launch(dist_train_worker.spawned_aamoe, 2, tmp_path / "results", path)
    single = train_worker.run(tmp_path / "one" / "checkpoint.safetensors", cfg=cfg, model_fn=train_worker.aamoe_model)
    for a, b in zip(per_rank[0]["history"], single["history"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a, b)
    two, _ = load_model(path)
    one, _ = load_model(tmp_path / "one" / "checkpoint.safetensors")
    init = train_worker.aamoe_model()
    for (name, p), q, p0 in zip(two.named_parameters(), one.parameters(), init.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
        if ".predictor." in name and name.endswith("weight"):
            assert not torch.equal(p, p0), f"{name} never changed"
