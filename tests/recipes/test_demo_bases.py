"""The pretrained bases the demo starts from: the shipped files themselves (they load, fit the cpu preset and
give the held-out numbers their provenance records), and the demo's use of a base (tiny stand-ins made by
scripts/make_demo_bases.py): it starts from one by default and says so, --pretrain trains one, a damaged one
is refused in one line with nothing in the run folder changed."""

import importlib.util
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from allhere.cli import main
from allhere.data.corpus import eval_windows, stdlib_corpus
from allhere.runtime.model_checkpoint import load_model
from allhere_recipes import bases
from allhere_recipes.plans import TASKS, plans
from allhere_recipes.tasks import task_data

ROOT = Path(__file__).resolve().parents[2]


def script():
    spec = importlib.util.spec_from_file_location("make_demo_bases", ROOT / "scripts" / "make_demo_bases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The shipped files -------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_shipped_base_loads_fits_and_gives_its_recorded_heldout_loss(task):
    plan = plans("cpu", "cpu")[task]
    base = bases.load_base(task, plan)  # the sha256 of its provenance, the preset's model config, every shape
    prov = base.provenance
    assert prov["model_config"] == plan.model.to_dict() and prov["steps"] == plan.pretrain.steps
    assert prov["train_config"] == plan.pretrain.to_dict() and prov["seed"] == plan.pretrain.seed
    assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]) and not prov["tree_modified"]
    assert prov["command"].startswith("python3 scripts/make_demo_bases.py")
    model, meta = load_model(base.path)  # an allhere checkpoint: generate, perplexity and analyze read it too
    assert meta["model_config"] == plan.model.to_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.model.state_dict().values()))
    data = task_data(task, plan)
    if data.fingerprint != prov["data"]["fingerprint"]:
        pytest.skip(f"the {task} data here is not the data the base was scored on ({prov['data']['description']}; "
                    f"here {data.description}): the held-out loss is not comparable")
    held = prov["heldout"]
    assert held["sequences"] == plan.eval_sequences
    again = bases.heldout(task, plan, data, base.model)
    assert again["loss"] == pytest.approx(held["loss"], rel=1e-3)
    if task == "stdlib":  # the same number computed here, not through the evaluation code
        windows = eval_windows(stdlib_corpus().val, held["seq_len"], held["sequences"])
        with torch.no_grad():
            logits = base.model(windows).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()
        assert loss == pytest.approx(held["loss"], rel=1e-3)
    else:
        assert again["accuracy"] == pytest.approx(held["accuracy"], abs=2e-3)


def test_shipped_bases_are_small_and_in_the_package_data():
    files = sorted(p for p in bases.BASES.iterdir() if not p.name.startswith("."))
    assert [p.name for p in files] == sorted(f"cpu-{t}.{ext}" for t in TASKS for ext in ("json", "safetensors"))
    assert sum(p.stat().st_size for p in files) <= 10 * 2**20
    text = (ROOT / "pyproject.toml").read_text()
    globs = re.search(r'"allhere_recipes" = \[([^\]]*)\]', text).group(1)
    patterns = [g.strip().strip('"') for g in globs.split(",") if g.strip()]
    root = bases.BASES.parent
    assert all(any(p.relative_to(root).match(g) for g in patterns) for p in files)


# The demo with a base (tiny stand-ins) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def made_bases(tmp_path_factory):
    """Bases of the tiny preset, made once by the script, standing in for the shipped ones."""
    folder = tmp_path_factory.mktemp("bases")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bases, "PRESET", "tiny")
        make = script()
        for task in TASKS:
            make.make(task, folder / "pretraining", "bf16", folder, "python3 scripts/make_demo_bases.py (test)")
    return folder


@pytest.fixture
def tiny_bases(made_bases, tmp_path, monkeypatch):
    """A copy of the tiny bases that the demo takes for the shipped ones (the test may damage it)."""
    folder = tmp_path / "bases"
    folder.mkdir()
    for path in made_bases.glob("tiny-*"):
        shutil.copy(path, folder / path.name)
    monkeypatch.setattr(bases, "PRESET", "tiny")
    monkeypatch.setattr(bases, "BASES", folder)
    return folder


def demo(*args):
    return main(["demo", "--preset", "tiny", "--device", "cpu", "--no-progress", *args])


def test_demo_starts_from_the_shipped_base_and_says_so(tiny_bases, tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo("--out", str(out)) == 0
    printed = capsys.readouterr().out
    for task in TASKS:
        prov = json.loads((tiny_bases / f"tiny-{task}.json").read_text())
        said = f"{task}: starting from the shipped base tiny-{task}.safetensors, pretrained 6 steps by allhere " \
               f"{prov['commit'][:7]}"
        assert said in printed
        report = json.loads((out / "report.json").read_text())["tasks"][task]
        assert report["base"] == {"file": f"tiny-{task}.safetensors", "sha256": prov["sha256"], "steps": 6,
                                  "commit": prov["commit"]}
        # the run folder's pretrained model is the base (fp32 of its bf16 weights), trained no further
        copy, meta = load_model(out / task / "pretrain" / "checkpoint.safetensors")
        shipped, _ = load_model(tiny_bases / f"tiny-{task}.safetensors")
        assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), shipped.state_dict().values()))
        assert meta["base"] == report["base"] and meta["history"] == []
        key = "loss" if task == "stdlib" else "accuracy"  # the base scores here what it scored when saved
        assert report["rows"]["full (pretrained)"][key] == pytest.approx(prov["heldout"][key], rel=1e-5)
    md = (out / "report.md").read_text()
    assert "Base: shipped base tiny-stdlib.safetensors, pretrained 6 steps by allhere" in md
    assert f"(CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)" in md
    # the control is fine-tuned from the same base for as many steps as AHA
    aha = json.loads((out / "stdlib" / "aha" / "checkpoint.json").read_text())
    control = json.loads((out / "stdlib" / "full-finetuned" / "checkpoint.json").read_text())
    assert aha["step"] == control["step"] == aha["train_config"]["steps"] == 4
    assert aha["train_config"] == control["train_config"]
    # --pretrain cannot silently go on from the shipped base; plain `allhere demo` goes on
    before = (out / "stdlib" / "aha" / "checkpoint.safetensors").read_bytes()
    assert demo("--out", str(out), "--pretrain") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "started from the shipped base tiny-stdlib.safetensors" in err[0]
    assert demo("--out", str(out)) == 0
    assert "stdlib: base shipped base tiny-stdlib.safetensors" in capsys.readouterr().out
    assert (out / "stdlib" / "aha" / "checkpoint.safetensors").read_bytes() == before  # reused


def test_pretrain_flag_pretrains_here(tiny_bases, tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo("--out", str(out), "--task", "recall", "--pretrain") == 0
    assert "recall: base pretrained in this run (6 steps; --pretrain)" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["tasks"]["recall"]["base"] is None
    assert len(json.loads((out / "recall" / "pretrain" / "checkpoint.json").read_text())["history"]) == 3


def test_other_pretraining_steps_pretrain_here_and_say_why(tiny_bases, tmp_path, capsys):
    assert demo("--out", str(tmp_path / "d"), "--task", "recall", "--pretrain-steps", "2") == 0
    assert "recall: base pretrained in this run (2 steps; --pretrain-steps 2: the shipped base has 6)" in \
        capsys.readouterr().out


def test_compare_goes_on_from_the_folders_base(tiny_bases, recall_run, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(recall_run, out)
    pretrained = (out / "recall" / "pretrain" / "checkpoint.safetensors").read_bytes()
    assert main(["compare", "--out", str(out), "--preset", "tiny", "--task", "recall", "--steps", "1",
                 "--seeds", "0", "--device", "cpu", "--no-progress"]) == 0
    assert (out / "recall" / "pretrain" / "checkpoint.safetensors").read_bytes() == pretrained


@pytest.fixture(scope="module")
def recall_run(made_bases, tmp_path_factory):
    """A finished recall run of the demo, started from the tiny recall base."""
    out = tmp_path_factory.mktemp("recall") / "demo"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bases, "PRESET", "tiny")
        mp.setattr(bases, "BASES", made_bases)
        assert demo("--out", str(out), "--task", "recall") == 0
    return out


def damage_truncated(path, prov):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_shapes(path, prov):
    """A well-formed base of a wider model, its sha256 in the provenance: only the shapes are wrong."""
    import dataclasses
    import hashlib

    from allhere.model import Decoder

    cfg = dataclasses.replace(plans("tiny", "cpu")["stdlib"].model, d_model=64)
    bases.save_base(path, Decoder(cfg), {"step": 6}, torch.bfloat16)
    prov["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_suffix(".json").write_text(json.dumps(prov))


def damage_config(path, prov):
    prov["model_config"]["d_model"] = 64
    path.with_suffix(".json").write_text(json.dumps(prov))


@pytest.mark.parametrize("damage,message", [
    (damage_truncated, "is damaged"),
    (lambda path, prov: path.unlink(), "is missing"),
    (damage_shapes, "does not fit the preset's model (embed.weight is [256, 64], the model's [256, 32]"),
    (damage_config, "was made for another model (d_model differ"),
    (lambda path, prov: path.with_suffix(".json").unlink(), "provenance of the shipped base"),
    (lambda path, prov: path.with_suffix(".json").write_text("{not json"), "is unreadable"),
    (lambda path, prov: path.with_suffix(".json").write_text("{}"), "lacks sha256"),
], ids=["truncated", "missing", "wrong-shapes", "other-config", "no-provenance", "bad-provenance",
        "empty-provenance"])
def test_damaged_base_is_refused_in_one_line_and_nothing_is_changed(tiny_bases, recall_run, tmp_path, capsys,
                                                                     damage, message):
    out = tmp_path / "demo"
    shutil.copytree(recall_run, out)  # a finished run in the folder
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    path = tiny_bases / "tiny-stdlib.safetensors"
    damage(path, json.loads(path.with_suffix(".json").read_text()))
    assert demo("--out", str(out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "tiny-stdlib" in err[0], err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # nothing written, nothing lost
    assert demo("--out", str(tmp_path / "new"), "--task", "stdlib") == 2
    assert not (tmp_path / "new").exists()


def test_the_folder_keeps_its_base_even_when_the_shipped_one_is_damaged(tiny_bases, recall_run, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(recall_run, out)
    (tiny_bases / "tiny-recall.safetensors").write_bytes(b"garbage")
    assert demo("--out", str(out), "--task", "recall") == 0  # its copy in the folder is the base


def test_make_script_records_provenance(tiny_bases):
    prov = json.loads((tiny_bases / "tiny-stdlib.json").read_text())
    for key in ("command", "commit", "date", "python", "torch", "cpu_capability", "threads", "steps", "seed",
                "model_config", "train_config", "heldout", "heldout_fp32", "pretrain_evals"):
        assert key in prov, key
    assert prov["data"]["fingerprint"]["val_bytes"] > 0 and len(prov["data"]["fingerprint"]["val_sha256"]) == 64
    assert prov["dtype"] == "bf16" and math.isfinite(prov["heldout"]["loss"])
    assert prov["python"] == ".".join(map(str, sys.version_info[:3]))
