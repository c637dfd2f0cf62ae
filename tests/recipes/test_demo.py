"""The main job end to end on the tiny preset, and its handling of bad input."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from allhere.cli import main
from allhere.data.corpus import eval_windows, stdlib_corpus, text_corpus
from allhere.eval.perplexity import rolling_perplexity
from allhere.runtime.model_checkpoint import load_model

from tb_events import events, scalars


def run(*args):
    return main(["demo", "--preset", "tiny", "--device", "cpu", "--no-progress", *args])


@pytest.fixture(scope="module")
def corpus():
    """The stdlib corpus (loaded once for the module)."""
    return stdlib_corpus()


def own_texts(folder):
    """A small corpus of the user's own text: 30 files of a few lines (short held-out documents)."""
    folder.mkdir()
    for i in range(30):
        (folder / f"f{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 10)
    return folder


@torch.no_grad()
def heldout_loss_and_gates(ckpt, settings, stdlib):
    """Loss (nats/token) and mean hard gate of a saved model on the stdlib task's held-out windows,
    computed here from the checkpoint and the run's settings.json (not through the evaluation code)."""
    plan = json.loads(settings.read_text())["plan"]
    windows = eval_windows(stdlib.val, plan["seq_len"], plan["eval_sequences"])
    model, _ = load_model(ckpt)
    out = model.eval()(windows)
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), windows[:, 1:].flatten()).item()
    gates = torch.stack([r.gates.float().mean() for r in out.routing.per_layer]).mean().item()
    return loss, gates


def test_tiny_demo_writes_report_and_reuses_its_run(tmp_path, capsys, corpus):
    out = tmp_path / "demo"
    assert run("--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "Retain %" in printed and "mu_f retrieval tokens" in printed
    report = json.loads((out / "report.json").read_text())
    stdlib = report["tasks"]["stdlib"]["rows"]
    assert set(stdlib) == {"full (pretrained)", "AHA w=8 (fine-tuned)", "sliding w=8 (pretrained, no fine-tuning)",
                           "full (pretrained + the same fine-tuning steps, control)"}
    assert stdlib["full (pretrained)"]["retain_percent"] == pytest.approx(100.0)
    assert (stdlib["full (pretrained)"]["mu_f"] == 1.0
            and stdlib["sliding w=8 (pretrained, no fine-tuning)"]["mu_f"] == 0.0)
    aha = stdlib["AHA w=8 (fine-tuned)"]
    loss, gates = heldout_loss_and_gates(out / "stdlib" / "aha" / "checkpoint.safetensors",
                                         out / "stdlib" / "settings.json", corpus)
    assert aha["loss"] == pytest.approx(loss, rel=1e-5) and aha["mu_f"] == pytest.approx(gates, abs=1e-6)
    assert report["tasks"]["stdlib"]["aha_layers"] == [0, 1]
    recall = report["tasks"]["recall"]["rows"]["AHA w=8 (fine-tuned)"]
    assert {"accuracy", "mu_f_retrieval", "mu_f_other"} <= set(recall)
    assert (out / "report.md").read_text().startswith("# allhere demo report")
    assert (out / "mu_f_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert_heldout_events(out, report)
    ckpt = out / "stdlib" / "aha" / "checkpoint.safetensors"
    before = ckpt.stat().st_mtime_ns
    assert run("--out", str(out)) == 0  # finished checkpoints are reused, not retrained
    assert ckpt.stat().st_mtime_ns == before
    again = json.loads((out / "report.json").read_text())
    assert again["tasks"]["stdlib"]["rows"] == report["tasks"]["stdlib"]["rows"]
    assert_heldout_events(out, again)  # measured again: each number once


def assert_heldout_events(out, report):
    """Each AHA fine-tuning run's TensorBoard events (read back with TensorBoard's reader): the mu_f heatmap at its
    evaluations and the report's held-out row, heatmap included, at its last step; the control's row too."""
    pytest.importorskip("matplotlib")
    for task in ("stdlib", "recall"):
        acc = events(out / task / "aha" / "tensorboard")
        row = report["tasks"][task]["rows"]["AHA w=8 (fine-tuned)"]
        assert [i.step for i in acc.Images("eval/mu_f_heatmap")] == [2, 4], task
        assert [i.step for i in acc.Images("heldout/mu_f_heatmap")] == [4], task
        assert scalars(acc, "heldout/mu_f") == [(4, pytest.approx(row["mu_f"], rel=1e-6))], task
    acc, row = events(out / "stdlib" / "aha" / "tensorboard"), report["tasks"]["stdlib"]["rows"]["AHA w=8 (fine-tuned)"]
    assert scalars(acc, "heldout/loss") == [(4, pytest.approx(row["loss"], rel=1e-6))]
    assert scalars(acc, "heldout/retain_vs_control_percent") == [(4, pytest.approx(row["retain_vs_control_percent"],
                                                                                    rel=1e-6))]
    control = events(out / "stdlib" / "full-finetuned" / "tensorboard")
    row = report["tasks"]["stdlib"]["rows"]["full (pretrained + the same fine-tuning steps, control)"]
    assert scalars(control, "heldout/loss") == [(4, pytest.approx(row["loss"], rel=1e-6))]
    assert control.Tags()["images"] == []  # a plain model: no routers, no heatmap


def test_other_settings_in_same_run_directory_are_refused(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run("--out", str(out), "--task", "recall") == 0
    ckpt = out / "recall" / "aha" / "checkpoint.safetensors"
    before = ckpt.read_bytes()
    assert run("--out", str(out), "--task", "recall", "--lam", "0.5") == 2
    assert "other settings" in capsys.readouterr().err
    assert ckpt.read_bytes() == before


def test_own_text_data(tmp_path):
    data = own_texts(tmp_path / "texts")
    assert run("--out", str(tmp_path / "own"), "--task", "stdlib", "--data", str(data)) == 0
    report = json.loads((tmp_path / "own" / "report.json").read_text())
    assert str(data) in report["tasks"]["stdlib"]["data"]


@pytest.mark.parametrize("args,message", [
    (["--data", "/no/such/path"], "no such file or folder"),
    (["--window", "48"], "window = 48 must be smaller"),
])
def test_bad_input_one_line_nonzero_exit(tmp_path, capsys, args, message):
    assert run("--out", str(tmp_path / "x"), "--task", "stdlib", *args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_corrupt_checkpoint_in_run_directory(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run("--out", str(out), "--task", "recall") == 0
    ckpt = out / "recall" / "pretrain" / "checkpoint.safetensors"
    ckpt.write_bytes(b"garbage")
    assert run("--out", str(out), "--task", "recall") == 2
    assert "corrupt" in capsys.readouterr().err
    assert ckpt.read_bytes() == b"garbage"  # not silently replaced


@pytest.mark.parametrize("args", [["--window", "0"], ["--lam", "-1"], ["--preset", "huge"], ["--device", "tpu"]])
def test_out_of_range_flags_exit_nonzero(args, capsys):
    assert run(*args) == 2
    assert "error" in capsys.readouterr().err


def test_analyze_a_finished_run(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run("--out", str(out)) == 0
    capsys.readouterr()
    assert main(["analyze", "--run", str(out), "--target-mu", "0.3"]) == 0
    printed = capsys.readouterr().out
    assert "static: top" in printed and "mean gap" in printed and "Budget control" in printed
    res = json.loads((out / "analysis" / "analysis.json").read_text())
    for task in ("stdlib", "recall"):
        r = res[task]
        assert r["static"]["mu_f"] >= r["dynamic"]["mu_f"] - 1e-9  # the static budget is never smaller
        assert len(r["stats"]["sorted_usage"]) == 4  # 2 layers x 2 heads in the tiny preset
        assert 0.0 < r["budget"]["tau"] < 1.0
    assert (out / "analysis" / "sorted_usage.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / "analysis" / "tokens_recall.html").read_text()
    assert "heads global" in page and page.count('<span class="t"') == 48  # one span per token
    assert main(["analyze", "--run", str(tmp_path / "nothing")]) == 2


def test_perplexity_command(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run("--out", str(out), "--task", "stdlib") == 0
    capsys.readouterr()
    ckpt = out / "stdlib" / "aha" / "checkpoint.safetensors"
    data = own_texts(tmp_path / "texts")
    assert main(["perplexity", "--checkpoint", str(ckpt), "--data", str(data), "--max-docs", "3",
                 "--seq-len", "48"]) == 0
    printed = capsys.readouterr().out
    again = rolling_perplexity(load_model(ckpt)[0], text_corpus(data).val_docs[:3], 48)
    assert f"{again['tokens']:,} tokens in 3 documents (0 skipped)" in printed
    assert f"perplexity {again['perplexity']:.3f}," in printed
    assert main(["perplexity", "--checkpoint", str(tmp_path / "none.safetensors")]) == 2


def test_sweep_tiny_is_resumable(tmp_path, capsys, corpus):
    args = ["sweep", "--preset", "tiny", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "sw"),
            "--windows", "4", "8", "64", "--lams", "0.01", "0.1"]
    assert main(args) == 0
    res = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    rows = res["tasks"]["stdlib"]["rows"]
    assert [r.get("skipped") is None for r in rows] == [True, True, False, True, True]  # 64 >= seq_len 48
    for r in (r for r in rows if "skipped" not in r):  # each its own checkpoint, with its window and lambda
        ckpt = tmp_path / "sw" / "stdlib" / f"w{r['window']}-lam{r['lam']:g}" / "checkpoint.safetensors"
        mech = load_model(ckpt)[0].cfg.mechanism
        assert (mech.window, mech.lam) == (r["window"], r["lam"])
        loss, gates = heldout_loss_and_gates(ckpt, tmp_path / "sw" / "stdlib" / "settings.json", corpus)
        assert r["bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-5)
        assert r["mu_f"] == pytest.approx(gates, abs=1e-6)
        assert r["retain_percent"] == pytest.approx(100 * res["tasks"]["stdlib"]["full"] / r["bits_per_token"])
        acc = events(ckpt.parent / "tensorboard")  # the row beside the run's curves, at its last step
        steps = max(e.step for e in acc.Scalars("train/loss"))
        for key in ("bits_per_token", "mu_f", "retain_percent"):
            assert scalars(acc, f"heldout/{key}") == [(steps, pytest.approx(r[key], rel=1e-6))], key
    md = (tmp_path / "sw" / "sweep.md").read_text()
    assert "Window sweep" in md and "Lambda sweep" in md and "n/a" in md
    ckpt = tmp_path / "sw" / "stdlib" / "w4-lam0.01" / "checkpoint.safetensors"
    before = ckpt.stat().st_mtime_ns
    assert main(args) == 0  # everything finished is reused
    assert ckpt.stat().st_mtime_ns == before
    assert (tmp_path / "sw" / "mu_f_vs_window.png").exists()


def test_dar_demo_tiny(tmp_path, capsys):
    out, data = tmp_path / "dar", own_texts(tmp_path / "texts")  # short held-out documents: fast perplexity
    assert run("--out", str(out), "--mechanism", "dar", "--windows", "4", "16", "--from-scratch",
               "--data", str(data)) == 0
    assert "uniform reduction d/4" in capsys.readouterr().out
    rep = json.loads((out / "dar_report.json").read_text())
    assert {"vanilla (pretrained)", "vanilla (+ stage-2 steps, control)", "DAR w=16 d/4",
            "uniform reduction d/4"} <= set(rep["rows"])
    for r in list(rep["rows"].values()) + list(rep["scratch_rows"].values()):
        assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
    # a row recomputed from its saved checkpoint: stage 2 of DAR w=16, on the same held-out documents
    model, _ = load_model(out / "stdlib" / "dar" / "w16-d8" / "stage2.safetensors")
    again = rolling_perplexity(model, text_corpus(data).val_docs[: rep["docs"]], 48, 24, min_len=rep["min_len"])
    assert rep["rows"]["DAR w=16 d/4"]["perplexity"] == pytest.approx(again["perplexity"], rel=1e-5)
    assert rep["rows"]["DAR w=16 d/4"]["rel_percent"] == pytest.approx(
        100 * again["perplexity"] / rep["rows"]["vanilla (+ stage-2 steps, control)"]["perplexity"], rel=1e-5)
    assert set(rep["scratch_rows"]) == {"vanilla", "DAR w=32 d/4", "uniform reduction d/4"}
    assert rep["scratch_rows"]["vanilla"]["perplexity"] == rep["rows"]["vanilla (pretrained)"]["perplexity"]
    assert rep["scratch_rows"]["vanilla"]["rel_percent"] == 100.0
    assert (out / "stdlib" / "dar" / "scratch-0-d8" / "checkpoint.safetensors").exists()


def test_stage_one_trains_only_the_bottleneck(tmp_path):
    import torch

    from allhere import DARConfig, Decoder, ModelConfig, swap_mechanism
    from allhere.config import TrainConfig
    from allhere.train import train

    base = Decoder(ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2))
    model = swap_mechanism(base, DARConfig(window=2, d_down=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(steps=3, batch_size=2, lr=1e-2)
    train(model, lambda s, m, g: torch.randint(0, 40, (2, 8), generator=g), cfg, tmp_path / "c.safetensors",
          progress=False, train_only=".mechanism.")
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (".mechanism." in n), n
        assert p.requires_grad


def test_flags_of_the_other_demo_are_errors(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["demo", "--out", str(out), "--windows", "4"]) == 2
    assert "--windows is for `allhere demo --mechanism dar`" in capsys.readouterr().err
    assert main(["demo", "--out", str(out), "--mechanism", "dar", "--lam", "0.1"]) == 2
    assert "--lam is for `allhere demo --mechanism aha`" in capsys.readouterr().err
    assert not out.exists()


def test_compare_tiny_reuses_the_demo_pretraining(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run("--out", str(out), "--task", "recall") == 0
    pretrained = (out / "recall" / "pretrain" / "checkpoint.safetensors").read_bytes()
    capsys.readouterr()  # the demo's report
    assert main(["compare", "--out", str(out), "--preset", "tiny", "--task", "recall", "--steps", "2",
                 "--seeds", "3", "--device", "cpu", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert "Seeds: 3." in printed and any(line.startswith("| sliding w=8 | 1 |") for line in table)
    assert len(table) == 8 and not any("±" in line for line in table)  # one seed: the means alone
    assert (out / "recall" / "pretrain" / "checkpoint.safetensors").read_bytes() == pretrained  # reused
    assert sorted(p.name for p in (out / "recall" / "compare" / "steps2").iterdir()) == ["seed3"]
    assert len(list((out / "recall" / "compare" / "steps2" / "seed3").glob("*/checkpoint.safetensors"))) == 7
    report = json.loads((out / "compare" / "compare.json").read_text())["tasks"]["recall"]
    rows = {label: {k: s["values"][0] for k, s in r.items()} for label, r in report["rows"].items()}
    assert report["seeds"] == [3] and all(s["std"] is None for r in report["rows"].values() for s in r.values())
    assert len(rows) == 7 and (out / "compare" / "compare.png").exists()
    n, w = report["seq_len"], report["window"]
    assert rows["full (control)"]["scores_per_query"] == pytest.approx((n + 1) / 2)
    assert rows["sliding w=8"]["scores_per_query"] == pytest.approx(sum(min(i + 1, w) for i in range(n)) / n)
    for r in rows.values():  # every local pattern at about the budget
        assert r["scores_per_query"] <= rows["full (control)"]["scores_per_query"] + 1e-9
    for folder, label in (("full", "full (control)"), ("aha", "AHA w=8")):  # each row beside its run's curves
        acc = events(out / "recall" / "compare" / "steps2" / "seed3" / folder / "tensorboard")
        for key in ("retain_percent", "density"):
            assert scalars(acc, f"heldout/{key}") == [(2, pytest.approx(rows[label][key], rel=1e-6))], (label, key)


def test_compare_seeds_mean_std_and_reuse(tmp_path):
    """Two seeds: the report's mean and sample standard deviation are those of the per-seed values, which
    differ between the seeds; a later call with a third seed trains only that one."""
    import statistics

    from allhere_recipes.compare import render, run_compare

    out = tmp_path / "demo"
    go = lambda seeds: run_compare(out, "tiny", ("recall",), 2, device="cpu", progress=False, seeds=seeds)  # noqa: E731
    first = go((0, 1))["tasks"]["recall"]
    assert first["seeds"] == [0, 1]
    for r in first["rows"].values():
        for key in ("accuracy", "scores_per_query", "density", "retain_percent"):
            s = r[key]
            assert s["n"] == 2 == len(s["values"])
            assert s["mean"] == pytest.approx(statistics.mean(s["values"]))
            assert s["std"] == pytest.approx(statistics.stdev(s["values"]))
    control = first["rows"]["full (control)"]
    assert control["retain_percent"]["values"] == [100.0, 100.0]  # each seed against its own control
    assert control["density"]["values"] == [1.0, 1.0]
    seed_dir = out / "recall" / "compare" / "steps2"
    weights = [load_model(seed_dir / f"seed{k}" / "full" / "checkpoint.safetensors")[0].state_dict() for k in (0, 1)]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # other batches, other weights
    assert any(len(set(s["values"])) == 2 for r in first["rows"].values() for s in r.values())
    table = render({"preset": "tiny", "device": "cpu", "torch": "", "seeds": [0, 1], "tasks": {"recall": first}})
    sliding = next(line for line in table.splitlines() if line.startswith("| sliding w=8 | 2 |"))
    assert sliding.count("±") == 4  # keys read, of full, accuracy, kept: mean ± std

    done = sorted(seed_dir.glob("seed[01]/*/checkpoint.safetensors"))
    assert len(done) == 14
    mtimes = [p.stat().st_mtime_ns for p in done]
    second = go((0, 1, 2))["tasks"]["recall"]
    assert [p.stat().st_mtime_ns for p in done] == mtimes  # the finished runs are reused, not trained again
    assert len(list(seed_dir.glob("seed2/*/checkpoint.safetensors"))) == 7
    for label, r in second["rows"].items():
        assert r["accuracy"]["values"][:2] == first["rows"][label]["accuracy"]["values"]
        assert r["accuracy"]["n"] == 3
