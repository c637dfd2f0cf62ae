"""The vLLM serving tests run where vLLM is: vLLM pins its own torch and transformers, so it lives in an
environment of its own (scripts/install_serve.sh makes .venv-serve). From the main environment this test
runs test_serve_vllm.py and test_serve_e2e.py there; it is skipped when there is no such environment, and
fails when ALLHERE_SERVE_PYTHON names one that does not pass (CI sets it). Nothing there may be skipped but
the tests marked ``real``, which need a fine-tuned real model and are deselected here."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/serve/test_serve_vllm.py", "tests/serve/test_serve_e2e.py", "tests/serve/test_serve_sinks.py"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is in this Python: those tests ran here")
def test_serving_tests_pass_in_the_serving_environment():
    python = os.environ.get("ALLHERE_SERVE_PYTHON") or ROOT / ".venv-serve" / "bin" / "python"
    if "ALLHERE_SERVE_PYTHON" not in os.environ and not Path(python).exists():
        pytest.skip("no serving environment: bash scripts/install_serve.sh makes .venv-serve")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not real", *FILES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0 and "skipped" not in summary, run.stdout[-6000:] + run.stderr[-2000:]
    print(summary)
