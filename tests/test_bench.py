"""`allhere bench` runs its whole table; on the CPU only as an explicit smoke run (tiny sizes)."""

import json

import pytest
import torch

from allhere.cli import main


def test_bench_smoke_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--device", "cpu", "--lengths", "256", "--decode-lengths", "128", "--train-length", "128",
            "--heads", "2", "--dim", "16", "--window", "32", "--repeats", "1", "--model-lengths", "300",
            "--profile", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "bench.json").read_text())
    assert all(v < 1e-4 for v in report["check"].values())  # every path against the fp32 reference
    assert len(report["prefill"]) == len(report["decode"]) == 4 and len(report["training"]) == 4
    w = report["config"]["window"]
    for r in report["prefill"] + report["decode"]:
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["aha_ms"])
    for r in report["prefill"]:  # FLOPs: a share mu_f of the queries reads about n / 2 keys, the rest w
        assert r["limit"] == pytest.approx(1 / (r["mu_f"] + 2 * (1 - r["mu_f"]) * w / r["n"]))
    for r in report["decode"]:  # bytes: a global query reads the n cached keys, a local one w of them
        assert r["limit"] == pytest.approx(1 / (r["mu_f"] + (1 - r["mu_f"]) * min(1, w / r["n"])))
    for r in report["training"]:
        assert r["overhead"] == pytest.approx(r["aha_ms"] / r["dense_ms"])
    assert [(r["model"], r["n"]) for r in report["model"]] == [("Decoder", 300), ("converted Llama", 300)]
    for r in report["model"]:  # the routers set per (layer, head) give about 6.7% global tokens
        assert 0.02 < r["mu_f"] < 0.15 and r["speedup"] == pytest.approx(r["dense_ms"] / r["aha_ms"])
    md = (out / "bench.md").read_text()
    assert "## Decode" in md and "## Whole-model prefill" in md and "speed-up" in capsys.readouterr().out
    assert list(report["profile"]) == ["prefill, B = 1, n = 256", "decode, B = 8, n = 128",
                                       "training forward + backward, B = 1, n = 128"]
    assert all("Self CPU time total" in t for t in report["profile"].values()) and "## Where the time goes" in md
    assert "aten::" in report["profile"]["training forward + backward, B = 1, n = 128"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
