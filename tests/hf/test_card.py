"""The model card (README.md) that ``allhere convert`` and ``allhere sft`` write into their model folders
(``allhere.hf.card``): the Hub's parser reads it, it holds the mechanism and its settings as saved, the numbers are
the run's own, an input model's README is kept, and its Python snippet runs."""

import contextlib
import io
import json
import re

import pytest

transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

from huggingface_hub import ModelCard  # noqa: E402

from allhere.cli import main  # noqa: E402
from allhere.hf.card import BASE_HEADING, base_model_of  # noqa: E402

from hf_fixtures import write_chat, write_model  # noqa: E402

BASE_CARD = """---
license: apache-2.0
language: [en]
tags: [base-tag]
pipeline_tag: text-generation
base_model: HuggingFaceTB/SmolLM2-135M
---
# SmolLM2 tiny

What the base model is.

```python
# a comment, not a heading
```
"""


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A tiny SmolLM2 folder as the Hub publishes it: an old transformers' ``_name_or_path`` and its own card."""
    folder = write_model("SmolLM2-135M", tmp_path_factory.mktemp("card") / "m",
                         _name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    (folder / "README.md").write_text(BASE_CARD)
    return folder


def test_convert_writes_a_card_the_hub_parses(host, tmp_path):
    out = tmp_path / "aha"
    assert main(["convert", "--model", str(host), "--out", str(out), "--window", "8", "--sinks", "1",
                 "--no-progress"]) == 0
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the config's, not the base card's own
    assert (data["library_name"], data["pipeline_tag"]) == ("transformers", "text-generation")
    assert data["tags"] == ["allhere", "aha"] and data["license"] == "apache-2.0" and data["language"] == ["en"]
    saved = json.loads((out / "config.json").read_text())
    assert data["allhere"]["mechanism"] == saved["allhere_mechanism"]
    assert data["allhere"]["mechanism"]["window"] == 8 and data["allhere"]["mechanism"]["sinks"] == 1
    assert data["allhere"]["layers"] == saved["allhere_layers"] and data["allhere"]["made_by"] == "allhere convert"
    assert "results" not in data["allhere"] and "measured nothing" in card.text  # no number the run did not compute
    for command in (f"allhere generate --model {out} --prompt", f"allhere serve --model {out}"):
        assert command in card.text
    # the input model's card: its body kept (headings two levels down), its front matter merged or dropped
    kept = card.text.split(BASE_HEADING, 1)[1]
    assert "### SmolLM2 tiny" in kept and "What the base model is." in kept and "# a comment, not a heading" in kept
    assert "base-tag" not in card.content
    # the card's Python snippet loads the folder and generates
    snippet = re.search(r"```python\n(.*?)```", card.text, re.S).group(1).replace("max_new_tokens=20",
                                                                                  "max_new_tokens=2")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        exec(snippet, {})
    assert shown.getvalue().strip()


def test_sft_card_holds_the_runs_own_numbers(host, tmp_path):
    out = tmp_path / "sft"
    assert main(["sft", "--model", str(host), "--data", str(write_chat(tmp_path / "chat.jsonl")), "--window", "4",
                 "--seq-len", "32", "--batch-size", "4", "--global-batch", "4", "--max-steps", "2",
                 "--target-mu-f", "0.08", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    card = ModelCard.load(out / "model" / "README.md")
    data = card.data.to_dict()["allhere"]
    run = json.loads((out / "checkpoint.json").read_text())  # the run's own record
    last = run["history"][-1]
    assert data["results"] == {"steps": 2, "last_step_loss": last["lm"], "last_step_mu_f": last["mu_f"],
                               "final_lambda": run["lam"]}
    assert data["run"]["target_mu_f"] == 0.08 and data["run"]["data"] == "chat.jsonl"
    assert data["mechanism"]["window"] == 4 and f"{100 * last['mu_f']:.1f}%" in card.text
    assert BASE_HEADING in card.text and "What the base model is." in card.text


def test_a_plain_models_card_names_no_mechanism(host, tmp_path):
    """A plain model allhere fine-tuned (a job's control): its card says it has its own attention, claims no
    mechanism nor allhere's loader, and its snippet runs with transformers alone."""
    from transformers import AutoConfig

    from allhere.hf.card import Result, write_card

    out = tmp_path / "plain"
    out.mkdir()
    for f in host.iterdir():
        if f.name != "README.md":
            (out / f.name).write_bytes(f.read_bytes())
    write_card(out, AutoConfig.from_pretrained(str(out)), "a job", source=host,
               results=[Result("heldout_loss", 1.5, "held-out loss")])
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["tags"] == ["allhere"] and data["allhere"]["mechanism"] is None
    assert data["allhere"]["results"] == {"heldout_loss": 1.5} and data["license"] == "apache-2.0"
    assert "its own attention (no allhere mechanism)" in card.text and "transformers alone loads it" in card.text
    assert "without its mechanism" not in card.text and "does not serve" not in card.text
    assert f"allhere serve --model {out}" in card.text and "What the base model is." in card.text


def test_base_model_only_from_a_hub_id(tmp_path, monkeypatch):
    """A Hub id where one is known; a local path or anything else never."""
    snapshot = tmp_path / "hub" / "models--Org--Some-Model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert base_model_of(snapshot) == "Org/Some-Model"
    folder = tmp_path / "plain"
    folder.mkdir()
    for name_or_path, want in (("Org/Model-1.5B", "Org/Model-1.5B"), ("/home/me/model", None), ("./ckpt", None),
                               ("../a/b", None), ("gpt2", None), ("a--b/c", None), (str(snapshot), None)):
        (folder / "config.json").write_text(json.dumps({"_name_or_path": name_or_path}))
        assert base_model_of(folder) == want, name_or_path
    (folder / "config.json").write_text("{}")
    assert base_model_of(folder) is None
    (folder / "README.md").write_text("---\ntags: [allhere, aha]\nbase_model: Org/Model-1.5B\n---\n# x\n")
    assert base_model_of(folder) == "Org/Model-1.5B"  # a model allhere wrote: its own base
    (folder / "README.md").write_text("---\nbase_model: Org/Model-1.5B\n---\n# not ours\n")
    assert base_model_of(folder) is None  # another model's base is not this one's
    (folder / "README.md").write_text("---\n: [not yaml\n---\n# x\n")
    assert base_model_of(folder) is None

    from allhere.runtime import models_cache

    monkeypatch.setenv("ALLHERE_CACHE", str(tmp_path / "cache"))
    cached = models_cache._target("smollm2")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert base_model_of(cached) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_of(folder / "config.json") is None
