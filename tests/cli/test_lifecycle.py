"""Stopping a run: Ctrl-C / SIGTERM finish the step, checkpoint, print one line and exit 130 / 143; the run
resumes to exactly the weights of an uninterrupted one, after kill -9 too; a second process on the same run
folder is refused while the first one runs.

The subprocesses are ``allhere sft`` on a tiny local Llama (untied embeddings) started through ``GATED``,
which holds the training at a given step for as long as a gate file exists, so that every signal arrives at
a known step without a race."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from gated_process import launch_gated, stop_all  # noqa: E402

from allhere.cli import main  # noqa: E402
from allhere.config import TrainConfig  # noqa: E402
from allhere.runtime.interrupt import Interrupted  # noqa: E402
from allhere.runtime.runlock import LOCK_NAME  # noqa: E402
from allhere.train import train  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]

# ``allhere`` as its console script runs it, except that training waits at step GATE_STEP (first
# micro-batch) while the file GATE exists, after writing GATE.reached. Nothing else changes.
GATED = """
import os, sys, time
from pathlib import Path
import allhere.train
gate, at, draw = Path(os.environ["GATE"]), int(os.environ["GATE_STEP"]), allhere.train.step_generator
def gated(seed, step, micro):
    if step == at and micro == 0:
        Path(f"{gate}.reached").write_text(str(os.getpid()))
        while gate.exists():
            time.sleep(0.01)
    return draw(seed, step, micro)
allhere.train.step_generator = gated
from allhere.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny Llama (2 layers, width 32, untied embeddings), its WordLevel tokenizer and 48 conversations."""
    root = tmp_path_factory.mktemp("lifecycle")
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + ["<|user|>", "<|assistant|>", "<|system|>"] + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                               pad_token="<pad>", unk_token="<unk>")
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                                   bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(root / "base"))
    tok.save_pretrained(str(root / "base"))
    g = torch.Generator().manual_seed(0)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(48):
            q = [WORDS[i] for i in torch.randint(0, len(WORDS), (4,), generator=g).tolist()]
            msgs = [{"role": "user", "content": " ".join(q)}, {"role": "assistant", "content": " ".join(q[::-1])}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return root


def sft_args(chat, out, steps, global_batch=4):
    # no TensorBoard report: its line on stderr is tests/core/test_reporting.py's, the stop's one line is this file's
    return ["sft", "--model", str(chat / "base"), "--data", str(chat / "chat.jsonl"), "--window", "4",
            "--seq-len", "16", "--batch-size", "2", "--global-batch", str(global_batch), "--max-steps", str(steps),
            "--lr", "3e-3", "--device", "cpu", "--no-progress", "--report-to", "none", "--out", str(out)]


@pytest.fixture
def start_gated():
    """``start(args, gate, step)``: start ``allhere <args>`` held at ``step``; return the process once it waits
    there. Whatever a failed test leaves running is killed."""
    started = []

    def start(args, gate, step):
        return launch_gated(started, GATED, args, gate, {"GATE_STEP": str(step)}, "the gate")

    yield start
    stop_all(started)


def final_weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "model" / "model.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def straight(chat, tmp_path_factory):
    """The uninterrupted 6-step run's final weights."""
    out = tmp_path_factory.mktemp("straight") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(sft_args(chat, out, 6)) == 0
    finally:
        torch.set_num_threads(threads)
    return final_weights(out)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_signal_saves_one_line_and_resumes_exactly(chat, straight, tmp_path, one_thread, start_gated, sig,
                                                   code):
    out = tmp_path / "run"
    args = sft_args(chat, out, 6)
    proc = start_gated(args, tmp_path / "gate", step=2)  # held in its third step: two done
    if sig == signal.SIGINT:  # meanwhile a second process on the same folder is refused, and changes nothing
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        second = subprocess.run([sys.executable, "-m", "allhere.cli", *args, "--resume"], capture_output=True,
                                text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert second.returncode == 2
        assert second.stderr.strip() == (f"allhere sft: error: {out} is in use by process {proc.pid}, which writes "
                                         "a run there; wait for it to end or stop it (Ctrl-C saves and stops), or "
                                         "choose another folder (nothing was changed)")
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    proc.send_signal(sig)
    (tmp_path / "gate").unlink()  # the step in flight finishes, then the run stops
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.strip().splitlines() == [f"allhere sft: interrupted at step 3 of 6 (saved to "
                                        f"{out / 'checkpoint.safetensors'}); run the same command with --resume "
                                        "to continue"]  # one line, no traceback
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 3
    assert not (out / "model").exists() and not (out / LOCK_NAME).exists()

    assert main(args) == 2  # the folder holds a run: without --resume it is refused
    assert main(args + ["--resume"]) == 0
    assert_same_weights(final_weights(out), straight)


@pytest.mark.slow
def test_killed_after_its_first_checkpoint_resumes_exactly(chat, tmp_path, one_thread, start_gated):
    """sft checkpoints every 100 steps: kill -9 in step 101 of 102 loses that step only; the lock the dead
    process leaves behind is taken over."""
    out = tmp_path / "run"
    args = sft_args(chat, out, 102, global_batch=2)
    proc = start_gated(args, tmp_path / "gate", step=100)
    proc.kill()
    proc.communicate(timeout=60)
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 100
    assert (out / LOCK_NAME).read_text().strip() == str(proc.pid)  # left behind by the dead process
    assert main(args + ["--resume"]) == 0
    resumed = final_weights(out)
    assert main(sft_args(chat, tmp_path / "straight", 102, global_batch=2)) == 0
    assert_same_weights(resumed, final_weights(tmp_path / "straight"))


# The training loop and the command line in this process -------------------------------------------------

def tiny_model():
    from allhere import AHAConfig, Decoder, ModelConfig

    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               mechanism=AHAConfig(window=4, lam=0.01)))


CFG = TrainConfig(steps=8, batch_size=2, grad_accum=2, lr=3e-3, ckpt_every=100, log_every=1)


def signalling_batches(signals):
    """Batches that send this process ``signals[step]`` (a list of signals) while drawing step ``step``."""

    def batches(step, micro, g):
        if micro == 0:
            for sig in signals.get(step, ()):
                os.kill(os.getpid(), sig)
        return torch.randint(0, 50, (2, 16), generator=g)

    return batches


def test_train_stops_after_the_step_in_flight_and_restores_handlers(tmp_path):
    from allhere.runtime.model_checkpoint import read_checkpoint

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    path = tmp_path / "run" / "checkpoint.safetensors"
    with pytest.raises(Interrupted) as stop:
        train(tiny_model(), signalling_batches({2: [signal.SIGTERM]}), CFG, path, progress=False)
    assert (stop.value.step, stop.value.steps, stop.value.exit_code) == (3, 8, 143)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert read_checkpoint(path)[1]["step"] == 3
    resumed = train(tiny_model(), signalling_batches({}), CFG, path, resume=True, progress=False)
    straight = train(tiny_model(), signalling_batches({}), CFG, tmp_path / "straight" / "c.safetensors",
                     progress=False)
    assert resumed["history"] == straight["history"]


def test_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    from allhere.runtime.model_checkpoint import read_checkpoint

    path = tmp_path / "run" / "checkpoint.safetensors"
    cfg = dataclasses.replace(CFG, ckpt_every=2)
    with pytest.raises(Interrupted) as stop:
        train(tiny_model(), signalling_batches({5: [signal.SIGINT, signal.SIGINT]}), cfg, path, progress=False)
    assert stop.value.step is None and stop.value.exit_code == 130
    assert "stopped at once" in str(stop.value)
    assert read_checkpoint(path)[1]["step"] == 4  # the periodic one before: step 6 was never finished
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.json", "checkpoint.safetensors"]


def test_ctrl_c_outside_training_is_one_line(monkeypatch, capsys):
    import allhere_recipes.analyze as analyze
    import allhere_recipes.demo as demo

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    monkeypatch.setattr(demo, "run_demo", ctrl_c)
    assert main(["demo", "--preset", "tiny", "--no-progress"]) == 130
    assert capsys.readouterr().err == "allhere demo: interrupted; run the same command again to continue\n"
    monkeypatch.setattr(analyze, "analyze_run", terminated)
    assert main(["analyze", "--run", "."]) == 143
    assert capsys.readouterr().err == "allhere analyze: interrupted\n"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

