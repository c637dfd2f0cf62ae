"""``allhere convert --mechanism aha --calibration TEXT --mu-f SHARE``: a Hugging Face model converted to AHA with
its routers taught from the model's own attention on a text file (``allhere.teaching``), as the Python calls do;
bad settings and files refused in one line with nothing written."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhere import AHAConfig  # noqa: E402
from allhere.cli import main  # noqa: E402
from allhere.hf import HFCausalLM, convert, load_pretrained  # noqa: E402
from allhere.hf.io import load_local  # noqa: E402
from allhere.teaching import teach_routers, teaching_windows  # noqa: E402

from hf_fixtures import write_model  # noqa: E402

TEXT = "".join(f"def step_{i}(state):\n    return state * {i % 7} + {i % 5}  # keep going\n\n" for i in range(400))


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return write_model("SmolLM2-135M", tmp_path_factory.mktemp("host") / "m", init_std=0.1)


def test_convert_teaches_the_routers_as_python_does(host, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text(TEXT, encoding="utf-8")
    argv = ["convert", "--model", str(host), "--out", str(tmp_path / "a"), "--window", "8", "--sinks", "1",
            "--calibration", str(text), "--mu-f", "0.2", "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"routers taught on 32 windows of 512 tokens of {text} and 32 of plain sentences" in err
    assert re.search(r"mu_f (19\.[5-9]|20\.[0-4])% there", err), err
    from huggingface_hub import ModelCard  # the folder's card: the teaching's own numbers, as printed

    card = ModelCard.load(tmp_path / "a" / "README.md").data.to_dict()["allhere"]
    assert f"mu_f {card['results']['calibration_mu_f']:.1%} there" in err and card["run"]["mu_f_target"] == 0.2
    assert f"send {card['results']['calibration_recall']:.0%} to full" in err
    got = load_pretrained(tmp_path / "a")
    mech = got.model.layers[0].self_attn.allhere
    assert mech.cfg == AHAConfig(window=8, sinks=1)
    tokenizer, want = load_local(host, convertible=True)
    convert(want, AHAConfig(window=8, sinks=1))
    windows, answers = teaching_windows(tokenizer, TEXT, 8)
    taught = teach_routers(want, list(windows.split(1)), 0.2, answers=list(answers.split(1)))
    assert abs(taught.mu_f - 0.2) < 0.01
    ref = want.model.layers[0].self_attn.allhere
    assert torch.allclose(mech.router.weight.float(), ref.router.weight.float(), rtol=1e-2, atol=1e-3)
    assert not torch.allclose(mech.router.bias.float(), torch.full_like(mech.router.bias.float(), 3.0))
    with torch.no_grad():
        routed = HFCausalLM(got.float())(windows[:4]).routing.mu_f().item()
    assert 0.1 < routed < 0.3  # the budget holds on the text it was taught on (weights saved as published)


@pytest.mark.parametrize("extra, message", [
    (["--mu-f", "0.1"], "--mu-f is the budget of routers taught from --calibration TEXT"),
    (["--mu-f", "1.5", "--calibration", "calib.txt"], "--mu-f"),
    (["--sinks", "8", "--calibration", "calib.txt"], "AHAConfig.sinks = 8 is invalid: expected fewer than window"),
    (["--calibration", "empty.txt"], "empty.txt: the file holds no text"),
    (["--calibration", "binary.txt"], "not UTF-8 text"),
    (["--calibration", "short.txt"], "short.txt: the text has"),
    (["--calibration", "calib.txt", "--mechanism", "sliding"], "--mechanism sliding takes no calibration text"),
    (["--calibration", "missing.txt"], "missing.txt"),
])
def test_bad_settings_and_files_are_refused_in_one_line(host, tmp_path, capsys, extra, message):
    (tmp_path / "calib.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "short.txt").write_text("x = 1\n" * 20, encoding="utf-8")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00 not text" * 50)
    extra = [str(tmp_path / e) if e.endswith(".txt") else e for e in extra]
    capsys.readouterr()
    assert main(["convert", "--model", str(host), "--out", str(tmp_path / "out"), "--window", "8", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
