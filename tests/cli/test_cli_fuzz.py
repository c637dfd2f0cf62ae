"""Bad inputs found by fuzzing the commands by hand (beyond the per-option values of test_cli_input.py):
damaged model folders and run folders, impossible output folders, degenerate lengths. Each gets one line
on stderr, exit code 2, and leaves what was there untouched."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from allhere.cli import main  # noqa: E402

from hf_fixtures import write_chat, write_model  # noqa: E402


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    good = write_model("Llama-3.2-1B", root / "good")
    folders = {"good": good, "chat": write_chat(root / "chat.jsonl")}
    no_weights = root / "no_weights"
    shutil.copytree(good, no_weights)
    (no_weights / "model.safetensors").unlink()
    truncated = root / "truncated"
    shutil.copytree(good, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    shapes = root / "shapes"  # a config.json that does not fit the weights
    shutil.copytree(good, shapes)
    cfg = json.loads((shapes / "config.json").read_text())
    (shapes / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    (root / "empty.jsonl").write_text("")
    run = root / "run" / "stdlib"
    run.mkdir(parents=True)
    (run / "settings.json").write_text("{damaged")
    folders.update(no_weights=no_weights, truncated=truncated, shapes=shapes, empty=root / "empty.jsonl",
                   run=root / "run")
    return folders


def one_line(capfd) -> str:
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def snapshot(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("which, needle", [("no_weights", "no file named model.safetensors"),
                                           ("truncated", "SafetensorError"), ("shapes", "could not be loaded")])
@pytest.mark.parametrize("command", ["perplexity", "convert", "generate"])
def test_damaged_model_folders(damaged, tmp_path, capfd, which, needle, command):
    args = {"perplexity": [], "convert": ["--out", str(tmp_path / "o"), "--mechanism", "aha", "--window", "4"],
            "generate": ["--prompt", "w1 w2"]}[command]
    before = snapshot(damaged[which])
    assert main([command, "--model", str(damaged[which]), *args]) == 2
    line = one_line(capfd)
    assert line.startswith(f"allhere {command}: error: {damaged[which]}") and needle in line
    assert snapshot(damaged[which]) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["demo", "sweep"])
def test_damaged_settings_file(damaged, capfd, command):
    before = snapshot(damaged["run"])
    assert main([command, "--out", str(damaged["run"]), "--preset", "tiny"]) == 2
    assert "settings.json is damaged" in one_line(capfd)
    assert snapshot(damaged["run"]) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", ["demo", "sweep", "compare", "aamoe", "patterns", "bench"])
def test_output_folder_that_cannot_be_created(command, capfd):
    assert main([command, "--out", "/proc/allhere-cannot-be-here"]) == 2
    assert "cannot create the folder '/proc/allhere-cannot-be-here'" in one_line(capfd)


def test_degenerate_inputs(damaged, tmp_path, capfd):
    sft = ["sft", "--model", str(damaged["good"]), "--window", "4", "--out", str(tmp_path / "s")]
    assert main([*sft, "--data", str(damaged["empty"])]) == 2
    assert "is empty" in one_line(capfd)
    assert main([*sft, "--data", str(damaged["chat"]), "--seq-len", "1"]) == 2
    assert "at least 2 tokens" in one_line(capfd)
    assert main(["perplexity", "--model", str(damaged["good"]), "--seq-len", "1"]) == 2
    assert "at least 2 tokens" in one_line(capfd)
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_eval_task_whose_dataset_is_not_on_this_machine(damaged, tmp_path):
    """A Hub task (its dataset neither cached nor reachable) is one line, without retrying the network."""
    pytest.importorskip("lm_eval")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "empty-cache")
    done = subprocess.run([sys.executable, "-m", "allhere.cli", "eval", "--model", str(damaged["good"]), "--tasks",
                           "arc_easy", "--limit", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "could not be loaded" in err[0] and "offline" in err[0], err
