"""Chat formatting and SFT on a tiny local model and tokenizer built in the test (no downloads)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from allhere.data.chat import (  # noqa: E402
    FALLBACK_CHAT_TEMPLATE,
    load_chat,
    pack,
    tokenize_conversation,
)
from allhere.data.corpus import DataError  # noqa: E402
from allhere.hf import HFCausalLM, load_pretrained, sft  # noqa: E402
from allhere.losses import training_loss  # noqa: E402
from allhere.runtime.model_checkpoint import read_checkpoint  # noqa: E402

from helpers import rel_err  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]


def make_tokenizer():
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + ["<|user|>", "<|assistant|>", "<|system|>"] + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                                pad_token="<pad>", unk_token="<unk>")
    return fast


def conversation(rng, turns=2):
    msgs = [{"role": "system", "content": "w0 w1"}]
    for _ in range(turns):
        q = [WORDS[i] for i in torch.randint(2, 60, (4,), generator=rng).tolist()]
        msgs += [{"role": "user", "content": " ".join(q)},
                 {"role": "assistant", "content": " ".join(reversed(q))}]  # learnable: echo reversed
    return msgs


@pytest.fixture
def local_model(tmp_path):
    tok = make_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                   pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(tmp_path / "base"))
    tok.save_pretrained(str(tmp_path / "base"))
    rng = torch.Generator().manual_seed(0)
    with open(tmp_path / "chat.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"messages": conversation(rng)}) + "\n")
    return tmp_path


def test_assistant_mask_covers_replies_only():
    tok = make_tokenizer()
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    msgs = conversation(torch.Generator().manual_seed(1), turns=2)
    ids, mask = tokenize_conversation(tok, msgs)
    trained = tok.decode([t for t, m in zip(ids, mask) if m]).split()
    expected = []
    for m in msgs:
        if m["role"] == "assistant":
            expected += m["content"].split() + ["</s>"]
    assert trained == expected
    packed_ids, packed_mask, starts = pack([(ids, mask)] * 5, 16)
    assert packed_ids.shape == packed_mask.shape == starts.shape == (len(ids) * 5 // 16, 16)
    doc_starts = [c * len(ids) for c in range(5)]  # where each conversation starts in the stream
    expected = [max(max(d for d in doc_starts if d <= t), 16 * (t // 16)) - 16 * (t // 16)
                for t in range(starts.numel())]
    assert starts.flatten().tolist() == expected


def test_non_assistant_targets_contribute_nothing(local_model):
    tok = make_tokenizer()
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    ids, mask, _ = pack([tokenize_conversation(tok, conversation(torch.Generator().manual_seed(s)))
                         for s in range(8)], 32)
    from allhere import AHAConfig
    from allhere.hf import convert

    model = HFCausalLM(convert(transformers.AutoModelForCausalLM.from_pretrained(str(local_model / "base")),
                               AHAConfig(window=4)))
    out = model(ids)
    changed = ids.clone()
    changed[~mask] = 7  # every non-assistant target replaced
    a = training_loss(out, ids, 3e-4, loss_mask=mask).lm
    b = training_loss(out, changed, 3e-4, loss_mask=mask).lm
    assert torch.equal(a, b)
    assert not torch.equal(training_loss(out, ids, 3e-4).lm, training_loss(out, changed, 3e-4).lm)


def test_packed_conversations_attend_only_to_themselves(local_model):
    """The segment starts of pack() keep packed conversations apart through transformers' mask: the same
    logits as each conversation alone."""
    from allhere import AHAConfig
    from allhere.hf import convert

    tok = make_tokenizer()
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    convs = [tokenize_conversation(tok, conversation(torch.Generator().manual_seed(s), turns=1)) for s in range(3)]
    total = sum(len(c[0]) for c in convs)
    ids, _, starts = pack(convs, total)
    model = HFCausalLM(convert(transformers.AutoModelForCausalLM.from_pretrained(str(local_model / "base")),
                               AHAConfig(window=4, router_init="neutral"))).eval()
    with torch.no_grad():
        alone = torch.cat([model(torch.tensor([c[0]])).logits for c in convs], dim=1)
        packed = model(ids, segment_starts=starts).logits
        mixed = model(ids).logits  # without segments: one long document
    assert rel_err(packed, alone) < 1e-5
    assert rel_err(mixed, alone) > 1e-3


def test_sft_reduces_loss_and_trains_routers(local_model):
    out = local_model / "run"
    state = sft(local_model / "base", local_model / "chat.jsonl", out, window=4, seq_len=32, batch_size=4,
                global_batch=8, lr=3e-3, lam=1e-2, max_steps=30, progress=False)
    hist = state["history"]
    assert state["chat_template_fallback"] is True
    assert sum(h["lm"] for h in hist[-5:]) / 5 < sum(h["lm"] for h in hist[:5]) / 5 - 0.3
    tuned = load_pretrained(out / "model")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(local_model / "base"))
    from allhere import AHAConfig
    from allhere.hf import convert

    fresh = convert(base, AHAConfig(window=4, lam=1e-2))
    w_tuned = tuned.model.layers[0].self_attn.allhere.router.weight
    w_fresh = fresh.model.layers[0].self_attn.allhere.router.weight
    assert (w_tuned - w_fresh).abs().max() > 1e-3  # routers were trained
    reg = [h["loss"] - h["lm"] for h in hist]  # lambda * L_reg: the mean router score went down
    assert reg[-1] < reg[0]


def test_chat_data_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no messages here"}) + "\n")
    with pytest.raises(DataError, match="no 'messages' column"):
        load_chat(bad)
    with pytest.raises(DataError, match="does not exist"):
        load_chat(tmp_path / "missing.jsonl")
    tok = make_tokenizer()
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    with pytest.raises(DataError, match="role"):
        tokenize_conversation(tok, [{"content": "w1"}])


def test_cli_convert_and_sft(local_model, capsys):
    from allhere.cli import main

    assert main(["convert", "--model", str(local_model / "base"), "--out", str(local_model / "conv"),
                 "--window", "4"]) == 0
    assert load_pretrained(local_model / "conv").config.allhere_mechanism["window"] == 4
    args = ["sft", "--model", str(local_model / "base"), "--data", str(local_model / "chat.jsonl"), "--window", "4",
            "--seq-len", "32", "--batch-size", "4", "--global-batch", "8", "--max-steps", "2", "--device", "cpu",
            "--no-progress", "--out", str(local_model / "sft")]
    assert main(args) == 0
    assert "Model saved" in capsys.readouterr().out
    assert main(args) == 2  # the run folder holds a checkpoint: needs --resume
    assert "--resume" in capsys.readouterr().err
    other = local_model / "other.jsonl"  # half the conversations: --resume on other data is refused
    other.write_text("".join((local_model / "chat.jsonl").read_text().splitlines(keepends=True)[:32]))
    again = [str(other) if a == str(local_model / "chat.jsonl") else a for a in args]
    assert main(again + ["--resume"]) == 2
    assert "was trained on other data" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0  # the same data: resumed (here: already done)
    capsys.readouterr()
    assert main(["sft", "--model", str(local_model / "nope"), "--data", "x", "--window", "4", "--out", "y"]) == 2
    assert "argument --model: no such file or folder" in capsys.readouterr().err
    assert main(args[:-2] + ["--window", "999", "--out", str(local_model / "w")]) == 2
    assert "larger than the model's context" in capsys.readouterr().err
    assert main(args[:-2] + ["--target-mu-f", "0.1", "--out", str(local_model / "t")]) == 0
    assert "lambda " in capsys.readouterr().out  # the lambda the run reached
    history = read_checkpoint(local_model / "t" / "checkpoint.safetensors")[1]["history"]
    assert [h["lam"] for h in history][0] == 3e-4 and history[1]["lam"] != 3e-4
    assert main(args[:-2] + ["--sinks", "2", "--out", str(local_model / "s")]) == 0  # sinks reach the saved model
    assert load_pretrained(local_model / "s" / "model").config.allhere_mechanism["sinks"] == 2
    saved = [str(local_model / "s" / "model") if a == str(local_model / "base") else a for a in args[:-2]]
    assert main(saved + ["--out", str(local_model / "s2")]) == 2
    assert "the same mechanism, window, threshold and sinks" in capsys.readouterr().err  # sinks 0 asked: refused


def test_dar_two_stage_sft(local_model):
    from allhere.runtime.model_checkpoint import read_checkpoint

    out = local_model / "dar"
    state = sft(local_model / "base", local_model / "chat.jsonl", out, window=4, seq_len=32, batch_size=4,
                global_batch=8, lr=3e-3, stage1_lr=1e-2, max_steps=15, progress=False, d_down=8)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(local_model / "base")).state_dict()
    stage1, meta1 = read_checkpoint(out / "stage1.safetensors")
    assert meta1["train_only"] == ".allhere." and meta1["stage"] == 1 and state["stage"] == 2
    dar_keys = [k for k in stage1 if ".allhere." in k]
    down = stage1["model.hf.model.layers.0.self_attn.allhere.down.weight"]
    up = stage1["model.hf.model.layers.0.self_attn.allhere.up.weight"]
    assert (up - down.T).abs().max() > 1e-3  # stage 1 trained the bottleneck (it starts with W_up = W_down^T)
    kept = [k for k in base if "model.hf." + k in stage1]
    assert len(kept) == len(base)
    for key in kept:  # stage 1 leaves every pretrained weight untouched
        assert torch.equal(stage1["model.hf." + key], base[key]), key
    tuned = load_pretrained(out / "model")
    assert tuned.config.allhere_mechanism == {"window": 4, "d_down": 8, "kind": "dar"}
    moved = [k for k, v in tuned.state_dict().items() if k in base and not torch.equal(v, base[k])]
    assert len(moved) > len(base) // 2  # stage 2 trains everything
    for k in dar_keys:  # the bottleneck trained in stage 1, and the final model holds the stage-2 weights
        assert not torch.equal(stage1[k], tuned.state_dict()[k[len("model.hf."):]])
    hist = state["history"]
    assert sum(h["lm"] for h in hist[-3:]) / 3 < sum(h["lm"] for h in hist[:3]) / 3


def test_cli_dar(local_model, capsys):
    from allhere.cli import main

    base = ["--model", str(local_model / "base"), "--window", "4"]
    assert main(["convert", *base, "--mechanism", "dar", "--d-down", "8", "--out", str(local_model / "c")]) == 0
    assert load_pretrained(local_model / "c").config.allhere_mechanism["d_down"] == 8
    assert main(["convert", *base, "--mechanism", "dar", "--out", str(local_model / "x")]) == 2
    assert "needs --d-down" in capsys.readouterr().err
    assert main(["convert", *base, "--d-down", "8", "--out", str(local_model / "x")]) == 2
    assert "--d-down is not a setting of --mechanism aha" in capsys.readouterr().err
    assert main(["convert", *base, "--mechanism", "dar", "--d-down", "8", "--tau", "0.6", "--out",
                 str(local_model / "x")]) == 2
    assert "--tau is not a setting of --mechanism dar" in capsys.readouterr().err
    assert main(["sft", *base, "--mechanism", "dar", "--d-down", "8", "--target-mu-f", "0.1", "--data",
                 str(local_model / "chat.jsonl"), "--out", str(local_model / "x")]) == 2
    assert "--target-mu-f is a setting of --mechanism aha" in capsys.readouterr().err
    assert not (local_model / "x").exists()
    before = sorted((local_model / "base").iterdir())
    for out, message in ((local_model / "base", "is the input model's folder"),
                         (local_model / "c", "already holds files")):  # the input model, an earlier output
        assert main(["convert", *base, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert sorted((local_model / "base").iterdir()) == before
    assert load_pretrained(local_model / "c").config.allhere_mechanism["kind"] == "dar"  # still the DAR model
    assert main(["sft", *base, "--mechanism", "dar", "--d-down", "8", "--data", str(local_model / "chat.jsonl"),
                 "--seq-len", "32", "--batch-size", "4", "--global-batch", "8", "--max-steps", "2", "--device",
                 "cpu", "--no-progress", "--out", str(local_model / "s")]) == 0
    assert "2 steps; last step: loss" in capsys.readouterr().out
    assert (local_model / "s" / "stage1.safetensors").exists() and (local_model / "s" / "model").exists()


def test_perplexity_of_hf_folders(local_model, capsys):
    from allhere.cli import main
    from allhere.data.corpus import text_corpus
    from allhere.eval.perplexity import hf_perplexity

    rng = torch.Generator().manual_seed(1)
    text = local_model / "text.txt"
    text.write_text(" ".join(WORDS[i] for i in torch.randint(0, 60, (3000,), generator=rng).tolist()))
    docs = text_corpus(text).val_docs
    assert main(["convert", "--model", str(local_model / "base"), "--window", "4", "--mechanism", "dar",
                 "--d-down", "32", "--out", str(local_model / "same")]) == 0  # d_down = d: no bottleneck
    base = hf_perplexity(local_model / "base", docs, seq_len=32, stride=16)
    same = hf_perplexity(local_model / "same", docs, seq_len=32, stride=16)
    assert base["tokens"] == same["tokens"] > 100
    assert same["perplexity"] == pytest.approx(base["perplexity"], rel=1e-5)
    assert main(["perplexity", "--model", str(local_model / "same"), "--data", str(text), "--seq-len", "32"]) == 0
    assert f"perplexity {same['perplexity']:.3f}" in capsys.readouterr().out


def test_lm_eval_model_loads_dar_folders(local_model):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from allhere.cli import main
    from allhere.eval.harness import AllhereLM

    base = ["convert", "--model", str(local_model / "base"), "--window", "4", "--mechanism", "dar"]
    assert main([*base, "--d-down", "32", "--out", str(local_model / "same")]) == 0  # d_down = d
    assert main([*base, "--d-down", "8", "--out", str(local_model / "small")]) == 0
    text = " ".join(WORDS[i] for i in range(40))
    req = Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))
    scores = {name: AllhereLM(str(local_model / name)).loglikelihood_rolling([req])[0]
              for name in ("base", "same", "small")}
    assert scores["same"] == pytest.approx(scores["base"], rel=1e-5)
    assert abs(scores["small"] - scores["base"]) > 1e-2  # the bottleneck was loaded and used
    assert AllhereLM(str(local_model / "small")).runner.model.config.allhere_mechanism["d_down"] == 8
