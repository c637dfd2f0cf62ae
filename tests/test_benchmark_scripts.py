"""The benchmark scripts a GPU session relies on still run (tiny sizes on the CPU; they measure nothing here)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke sizes are for the CPU interpreter")
def test_kernel_tiles_smoke():
    pytest.importorskip("triton")
    out = run_script("benchmarks/kernel_tiles.py", "--smoke")
    assert out.count("## ") == 3 and "WRONG" not in out and "failed" not in out


def test_sft_throughput_tiny():
    pytest.importorskip("transformers")
    out = run_script("benchmarks/sft_throughput.py", "--device", "cpu", "--tiny", "--steps", "12", "--warmup", "2",
                     "--batch-size", "2", "--seq-len", "64", "--window", "8")
    assert "routers start global | 1.000" in out and "routers start local | 0.000" in out
    out = run_script("benchmarks/sft_throughput.py", "--device", "cpu", "--tiny", "--steps", "4", "--warmup", "1",
                     "--batch-size", "2", "--seq-len", "64", "--window", "8", "--doc-len", "16",
                     "--router-init", "local")
    assert "documents of 16" in out and "routers start local" in out


def test_cpu_prefill_tables():
    for extra in ([], ["--training"], ["--padded"]):
        out = run_script("benchmarks/cpu_prefill.py", "--lengths", "128", "--heads", "2", "--dim", "8",
                         "--window", "16", "--repeats", "1", *extra)
        assert out.count("\n| 128 |") == 2  # one row per gate pattern
