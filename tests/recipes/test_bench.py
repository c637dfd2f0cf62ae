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
        assert r["aha_cache_view_ms"] > 0  # the same step on k, v lying in a longer cache buffer
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


@pytest.mark.slow
def test_whole_model_tables_smoke_run_on_cpu(tmp_path, capsys):
    """``allhere bench --device cpu --tables model``: the Llama-3.2-1B structure at toy sizes, prefill and
    decode through generate, plain against AHA; labelled as a smoke test (its numbers mean nothing)."""
    pytest.importorskip("transformers")
    out = tmp_path / "model"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine stalls a thread pool at every toy-sized decode step
    try:
        assert main(["bench", "--device", "cpu", "--tables", "model", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((out / "bench.json").read_text())
    llama = report["llama"]
    assert llama["settings"]["smoke"] and "check" not in report and "prefill" not in report  # no op tables
    assert llama["shape"]["rope_scaling"]["rope_type"] == "llama3" and llama["shape"]["tie_word_embeddings"]
    assert [p["n"] for p in llama["prefill"]] == [256] and 0.05 < llama["prefill"][0]["mu_f"] < 0.2
    rows = llama["decode"]
    plain = [f"plain (transformers SDPA, {c})" for c in ("torch's choice", "flash/efficient only")]
    assert [(r["context"], r["model"]) for r in rows] == [
        (c, m) for c in (128, 256) for m in (*plain, *plain, "AHA", "AHA, every gate local (ceiling)",
                                             f"{plain[0]}, captured step", "AHA, captured step")]
    static = [r for r in rows if r["cache"].startswith("StaticCache, one step run eagerly (no CUDA)")]
    assert [r["model"] for r in static] == [f"{plain[0]}, captured step", "AHA, captured step"] * 2
    assert all("error" not in r for r in static)
    by_backend = llama["prefill"][0]["plain_by_backend"]  # the plain prefill under each backend, the fastest kept
    assert set(by_backend) == {"torch's choice", "flash/efficient only"}
    assert llama["prefill"][0]["plain_ms"] == min(by_backend.values())
    assert by_backend[llama["prefill"][0]["plain_backend"]] == llama["prefill"][0]["plain_ms"]
    for r in rows:
        assert r["steps"] == 2 and r["tokens_per_s"] > 0 and r["cache_used_gb"] <= r["cache_gb"]
        assert (r["mu_f"] is not None) == (r["model"] == "AHA")  # a replay reads no routing
        # head 0 of every layer global: the first KV head of each layer is read whole, of 2
        read_whole = {"AHA": 0.5, "AHA, every gate local (ceiling)": 0.0, "AHA, captured step": 0.5}
        assert r["kv_heads_global"] == read_whole.get(r["model"], 1.0)
        assert (r["byte_limit"] == 1.0) == r["model"].startswith("plain")
    assert llama["prefill"][0]["flop_limit"] > 1
    # the in-place cache allocated once for the context and two runs of warm-up + timed tokens (+2: 10), in
    # 64-token grains, never reallocated:
    # 2 layers x (K, V) x batch 2 x 2 KV heads x head dim 8 x fp32
    aha = [r for r in rows if r["model"].startswith("AHA") and r not in static]
    assert [round(r["cache_gb"] * 1e9) for r in aha] == [2 * 2 * 2 * 2 * 8 * 4 * t for t in (192, 192, 320, 320)]
    # the static caches: exactly the context and the steps' room (128 + 10, 256 + 10), held from the start
    assert [round(r["cache_gb"] * 1e9) for r in static] == [2 * 2 * 2 * 2 * 8 * 4 * t for t in (138, 138, 266, 266)]
    md = (out / "bench.md").read_text()
    assert "SMOKE TEST on the CPU" in md and "### Decode (B = 2" in md and "SMOKE TEST" in capsys.readouterr().out


def test_a_decode_row_out_of_memory_leaves_the_others(monkeypatch):
    """On an 80 GB GPU a 128k-token row could run out of memory: it says so, and the other rows still run."""
    pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache

    from allhere_recipes import generate_bench
    from allhere_recipes.llama_bench import (
        build_models,
        decode_rows,
        llama_tables,
        render_llama,
    )

    real = generate_bench.decode_steps

    def steps(model, ids, cache, *args, **kwargs):
        if isinstance(cache, DynamicCache) and type(cache.layers[0]).__name__ == "DynamicLayer":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, ids, cache, *args, **kwargs)

    monkeypatch.setattr(generate_bench, "decode_steps", steps)
    t = llama_tables("cpu", contexts=(128,), new_tokens=2)
    rows = decode_rows(t, *build_models(t), progress=lambda *_: None)
    assert [r.get("error", "ok")[:13] for r in rows] == ["out of memory", "ok", "ok", "ok", "ok", "ok", "ok"]
    assert max(r["speedup"] for r in rows if r["model"].startswith("plain") and "error" not in r) == 1.0
    table = render_llama({"settings": vars(t), "shape": {"hidden_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256},
                          "parameters": 1, "transformers": "x", "load_before": (0, 0, 0), "load_after": (0, 0, 0),
                          "prefill": [], "decode": rows})
    assert any("| out of memory: CUDA out of memory" in line for line in table)


def test_launch_settings_section_names_each_choice_and_the_tuning_cost():
    from allhere_recipes.ops_bench import render_launch_settings

    choices = [{"id": "H100 sm90|triton 3.6.0|global|d128-bfloat16-g1-n32768", "setting": dict(BLOCK_M=128, BLOCK_N=128,
                num_warps=8, num_stages=3), "ms": 1.9, "tried": 8, "tuning_s": 4.5, "source": "tuned"},
               {"id": "H100 sm90|triton 3.6.0|decode|d128-bfloat16-g1-n131072-bh128", "setting": dict(SPLIT=1024,
                BLOCK_N=64, num_warps=4, num_stages=3), "ms": 0.3, "tried": 7, "tuning_s": 0.0, "source": "file"}]
    md = "\n".join(render_launch_settings(choices))
    assert ("4.5 s in all" in md
            and "| global | d128-bfloat16-g1-n32768 | (128, 128, 8, 3) | 1.9 | 8 | 4.5 | tuned |" in md)
    assert "| decode |" in md and "| file |" in md
    assert "Pinned" in "\n".join(render_launch_settings("pinned")) and render_launch_settings([]) == []


def test_bench_pin_tiles_is_recorded(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--device", "cpu", "--lengths", "128", "--decode-lengths", "64", "--train-length", "64",
                 "--heads", "2", "--dim", "16", "--window", "16", "--repeats", "1", "--model-lengths", "128",
                 "--pin-tiles", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["pin_tiles"] and report["launch_settings"] == "pinned"
    assert "Pinned (`--pin-tiles`)" in (out / "bench.md").read_text()


def test_back_to_back_columns_line_up_with_their_header():
    """On CUDA each prefill / decode row also has its calls timed back to back (``stream_time``); the
    table then grows three columns, header, rule and rows alike (rendered here from such rows)."""
    from allhere_recipes.ops_bench import render
    from allhere_recipes.timing import stream_time

    assert stream_time(lambda: None, device="cpu") is None  # off CUDA: nothing to add
    common = dict(pattern="uniform", mu_asked=0.07, mu_f=0.07, dense_backend="cudnn", dense_ms=2.0, aha_ms=1.0,
                  speedup=2.0, limit=10.0, dense_stream_ms=1.5, aha_stream_ms=0.25, speedup_stream=6.0,
                  aha_host_ms=0.2, aha_cache_view_ms=1.02)
    report = {"device_name": "a GPU", "torch": "x", "aha_path": "Triton kernels", "check": {"prefill": 1e-3},
              "config": dict(heads=16, dim=128, window=256, decode_batch=8),
              "prefill": [dict(n=4096, flex_sliding_ms=None, **common)], "decode": [dict(n=8192, batch=8, **common)],
              "training": []}
    md = render(report)
    for title in ("## Prefill", "## Decode"):
        head, rule, row = [line for line in md.split(title)[1].splitlines() if line.startswith("|")][:3]
        assert head.count("|") == rule.count("|") == row.count("|")
        assert "AHA, back to back" in head and "| 0.250 ms | 6.00x | 0.200 ms |" in row
    assert "| 1.02 ms (1.02x) |" in md.split("## Decode")[1]
    assert "20 calls issued in a row" in md
