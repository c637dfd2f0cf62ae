"""Bad input on the command line: one line naming the option and the value, exit 2, nothing written.

``test_every_option_refuses_bad_values`` walks every option of every command from the parser itself, so an
option added without a validating type fails here."""

import argparse
import json

import pytest
import torch

from allhere.cli import COMMANDS, build_parser, main


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    (root / "file.txt").write_text("text\n")
    (root / "empty").mkdir()
    return {"missing": str(root / "missing"), "file": str(root / "file.txt"), "folder": str(root / "empty"),
            "under a file": str(root / "file.txt" / "sub")}


SECRET = {"API key"}  # argument types whose refused values the error must not repeat


def bad_values(type_name: str, paths: dict) -> list[str]:
    """Values each argument type must refuse, keyed by the type's name."""
    table = {
        "integer>=1": ["0", "-3", "1.5", "x", ""],
        "integer>=2": ["1", "0", "x"],
        "integer>=0": ["-1", "x", "nan"],
        "number>=0": ["-1e-3", "inf", "-inf", "nan", "x"],
        "number>0": ["0", "-1", "inf", "nan"],
        "number>0<1": ["0", "1", "1.5", "nan", "inf"],
        "device": ["gpu", "cuda:x", "cuda:99", "tpu"],
        "data path": [paths["missing"]],
        "file": [paths["missing"], paths["folder"]],
        "folder": [paths["missing"], paths["file"]],
        "model folder": [paths["missing"], paths["file"], paths["folder"]],
        "checkpoint or model folder": [paths["missing"], paths["file"], paths["folder"]],
        "output folder": [paths["file"], paths["under a file"]],
        "comma-separated names": ["", "a,,b", " , "],
        "text": ["", " "],
        "API key": ["", "a key", "tab\tkey", "k\u00e9y"],
        "host": ["", "no such host", "1.2.3.999", "-bad", "a..b"],
        "port": ["0", "70000", "x"],
    }
    assert type_name in table, f"no bad values listed for argument type {type_name!r}: add them here"
    return table[type_name]


def one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"allhere {command}: error: "), captured.err
    assert "Traceback" not in captured.err and not captured.out
    return lines[0]


def test_every_option_refuses_bad_values(paths, capsys):
    assert set(subparsers()) == {c.name for c in COMMANDS}
    checked = 0
    for command, parser in subparsers().items():
        for action in options(parser):
            flag = action.option_strings[0]
            if isinstance(action, argparse._StoreTrueAction):
                values = [None]  # a flag given a value
            elif action.choices is not None:
                values = ["no-such-choice"]
            else:
                assert action.type is not None, f"allhere {command} {flag} takes any string: give it a type"
                values = bad_values(action.type.__name__, paths)
            for value in values:
                argv = [command, f"{flag}={'1' if value is None else value}"]  # "=": values may start with "-"
                assert main(argv) == 2, argv
                line = one_error_line(capsys, command)
                assert flag in line, (argv, line)
                if value and getattr(action.type, "__name__", None) in SECRET:
                    assert value not in line, (argv, line)  # a secret is never echoed back
                elif value:
                    assert repr(value) in line or value in line, (argv, line)
                assert "_" not in line.split(":")[2].split()[0], line  # no internal names such as _positive
                checked += 1
    assert checked > 150


def test_every_option_says_what_it_does_and_its_default():
    for command, parser in subparsers().items():
        for action in options(parser):
            text = action.help or ""
            assert len(text) > 10, (command, action.option_strings)
            assert "default" in text or action.required or "this or --" in text, (command, action.option_strings)


def test_argument_errors_are_one_line_without_usage(capsys):
    for argv, command, message in [(["demo", "--bogus"], "demo", "unrecognized arguments: --bogus"),
                                   (["demo", "--pres", "tiny"], "demo", "unrecognized arguments: --pres"),  # --preset
                                   (["convert", "--window", "4"], "convert", "the following arguments are required"),
                                   (["nope"], None, "invalid choice")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err and "usage" not in err, err
        assert err.startswith(f"allhere {command}: error:" if command else "allhere: error:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["demo", "bench", "sft", "eval", "sweep"])
def test_cuda_without_cuda_is_one_line(command, capsys):
    assert main([command, "--device", "cuda"]) == 2
    assert "no CUDA device" in one_error_line(capsys, command)


def test_run_folder_is_claimed_only_once_the_data_is_good(tmp_path, capsys):
    binary = tmp_path / "random.bin"
    binary.write_bytes(bytes(torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0)).tolist()))
    out = tmp_path / "demo"
    for data in (binary, tmp_path):  # a binary file; a folder whose only text-named file is binary
        if data == tmp_path:
            (tmp_path / "notes.txt").write_bytes(b"ok\n\x00\x01\x02" * 50)
            (tmp_path / "more.txt").write_bytes(b"\xff\xfe" * 50)
        for command in ("demo", "sweep"):
            assert main([command, "--preset", "tiny", "--device", "cpu", "--task", "stdlib", "--data", str(data),
                         "--out", str(out), "--no-progress"]) == 2
            assert "is not" in one_error_line(capsys, command)
    assert not out.exists()  # nothing claimed: a corrected run starts without "holds a run with other settings"


@pytest.mark.slow
def test_output_folders_holding_something_else_are_refused(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    for command in ("demo", "sweep"):
        assert main([command, "--preset", "tiny", "--device", "cpu", "--task", "recall", "--out", str(model)]) == 2
        assert "holds files but no allhere run" in one_error_line(capsys, command)
    assert sorted(p.name for p in model.iterdir()) == ["model.safetensors"]
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench.json").write_text("{}")
    args = ["bench", "--device", "cpu", "--lengths", "64", "--decode-lengths", "64", "--train-length", "64",
            "--heads", "1", "--dim", "8", "--window", "8", "--repeats", "1", "--model-lengths", "64",
            "--out", str(bench)]
    assert main(args) == 2
    assert "--force" in one_error_line(capsys, "bench")
    assert (bench / "bench.json").read_text() == "{}"
    assert main(args + ["--force"]) == 0
    assert json.loads((bench / "bench.json").read_text())["config"]["window"] == 8


@pytest.mark.slow
def test_unknown_lm_eval_task_is_one_line(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    ckpt = tmp_path / "x.safetensors"
    ckpt.write_bytes(b"never read: the tasks are checked first")
    assert main(["eval", "--model", str(ckpt), "--tasks", "no_such_task_xyz,also_missing"]) == 2
    line = one_error_line(capsys, "eval")
    assert "unknown lm-eval tasks no_such_task_xyz, also_missing" in line


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A tiny BERT (a masked LM, not causal), a config.json that is not json, and a chat file that is not chat."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32)
    transformers.BertForMaskedLM(cfg).save_pretrained(str(root / "bert"))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "chat.jsonl").write_text(json.dumps({"messages": "hello"}) + "\n")
    (root / "text.txt").write_text("plain text\n" * 200)
    return root


def test_models_that_are_not_causal_lms_are_one_line(hf_folders, capfd):
    bert, broken = str(hf_folders / "bert"), str(hf_folders / "broken")
    cases = [(["perplexity", "--model", bert, "--data", str(hf_folders / "text.txt")], "not a causal"),
             (["convert", "--model", bert, "--out", str(hf_folders / "o1"), "--window", "4"], "not a causal"),
             (["convert", "--model", broken, "--out", str(hf_folders / "o2"), "--window", "4"], "config.json is not")]
    for argv, message in cases:
        assert main(argv) == 2
        captured = capfd.readouterr()  # file descriptors: transformers' own handlers write there directly
        assert captured.err.count("\n") == 1 and message in captured.err and not captured.out, captured
    assert not (hf_folders / "o1").exists() and not (hf_folders / "o2").exists()


def test_sft_refuses_chat_data_that_is_not_chat_and_its_own_model_folder(hf_folders, capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=64)
    model = tmp_path / "llama"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(model))
    before = sorted(p.name for p in model.iterdir())
    capsys.readouterr()
    base = ["sft", "--model", str(model), "--window", "4", "--device", "cpu", "--no-progress"]
    assert main(base + ["--data", str(hf_folders / "chat.jsonl"), "--out", str(tmp_path / "run")]) == 2
    assert "'messages' must be a non-empty list" in one_error_line(capsys, "sft")
    for out in (model, model / "inside"):
        assert main(base + ["--data", str(hf_folders / "chat.jsonl"), "--out", str(out)]) == 2
        assert "the input model's folder" in one_error_line(capsys, "sft")
    for resume in ([], ["--resume"]):  # a run's own model as the input of a run into that run's folder
        assert main(base + ["--data", str(hf_folders / "chat.jsonl"), "--out", str(tmp_path), *resume]) == 2
        assert f"--out {tmp_path} holds the input model" in one_error_line(capsys, "sft")
    assert main(base + ["--data", str(hf_folders / "chat.jsonl"), "--out", str(tmp_path / "new"), "--resume"]) == 2
    assert "holds no run to continue" in one_error_line(capsys, "sft")
    chat = ["--data", str(hf_folders / "chat.jsonl"), "--out", str(tmp_path / "cp")]
    assert main(base + chat + ["--context-parallel", "2"]) == 2  # one process, no torchrun
    assert "context parallel 2 needs a multiple of 2 processes" in one_error_line(capsys, "sft")
    assert sorted(p.name for p in model.iterdir()) == before and not (tmp_path / "run").exists()
    assert not (tmp_path / "cp").exists()
