"""``allhere generate`` and ``allhere.generation``: streamed text, chat, cache, mu_f, bad input. Tiny models and
tokenizers built here (no downloads)."""

import io
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import allhere  # noqa: E402
import allhere.hf  # noqa: E402
from allhere.cli import main  # noqa: E402
from allhere.data.chat import FALLBACK_CHAT_TEMPLATE  # noqa: E402
from allhere.generation import (  # noqa: E402
    ByteTokenizer,
    TextStream,
    chat,
    generate,
    load,
    template_ids,
)
from allhere.runtime.model_checkpoint import load_model, save_checkpoint  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
TEXTS = ["café € 日本語 naïve wörld", "héllo wörld, ça va? 日本 über € 12.5", "second line: ünïcode ok."]
STEPS = 12


@pytest.fixture(autouse=True)
def generate_command(monkeypatch):
    """The command through ``allhere.cli.main``, registered here until it is in the command table."""
    cli = sys.modules["allhere.cli.main"]
    if "generate" not in {c.name for c in cli.COMMANDS}:
        from allhere.cli.generate import generate as run
        from allhere.cli.generate import generate_arguments

        command = cli.Command("generate", "generate text with a model, streamed", generate_arguments, run)
        monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + (command,))


def word_tokenizer():
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + ["<|user|>", "<|assistant|>", "<|system|>"] + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                                pad_token="<pad>", unk_token="<unk>")


def bpe_tokenizer():
    """Byte-level BPE (GPT-2's kind): multi-byte characters are split over tokens or merged into one."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def tiny_llama(tok, seed):
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                   pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders: a plain Llama (word tokenizer, no chat template), it converted to AHA, a Llama with a byte-level
    BPE tokenizer; and an allhere AHA Decoder checkpoint."""
    root = tmp_path_factory.mktemp("generate")
    paths = {}
    for name, tok in (("plain", word_tokenizer()), ("bpe", bpe_tokenizer())):
        model = tiny_llama(tok, seed=1)
        model.save_pretrained(str(root / name))
        tok.save_pretrained(str(root / name))
        paths[name] = str(root / name)
        if name == "plain":
            torch.manual_seed(2)
            allhere.hf.convert(model, allhere.AHAConfig(window=4, router_init="neutral"))
            allhere.hf.save_pretrained(model, root / "aha")
            tok.save_pretrained(str(root / "aha"))
            paths["aha"] = str(root / "aha")
    torch.manual_seed(3)
    decoder = allhere.Decoder(allhere.ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                  mechanism=allhere.AHAConfig(window=4, router_init="neutral")))
    with torch.no_grad():  # larger weights: varied bytes (multi-byte and invalid ones), not one byte repeated
        for name, p in decoder.named_parameters():
            if p.dim() == 2 and "router" not in name:
                p.mul_(10)
    paths["ckpt"] = str(root / "aha.safetensors")
    save_checkpoint(paths["ckpt"], decoder, None, {"step": 0})
    return paths


def prompt_of(name, tok):
    return tok.encode("w3 w1 w4 w1 w5 w9 w2 w6" if name in ("plain", "aha") else "héllo wörld, ça va? ")


def run(argv, capsys):
    capsys.readouterr()  # what the test printed before (transformers' loading bars outside the command)
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# Streaming --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["bpe", "bytes"])
def test_text_is_handed_on_whole_characters_as_it_comes(which):
    tok = bpe_tokenizer() if which == "bpe" else ByteTokenizer()
    text = "café € 日本語 naïve\nsecond line: ünïcode 🙂 한국어 ok."  # the last two: bytes, never merged
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    split = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert split, "no token boundary inside a character: the test would prove nothing"
    pieces = []
    stream = TextStream(tok, pieces.append)
    for i in ids:
        stream.put([i])
        if i == ids[len(ids) // 2]:
            assert pieces, "nothing handed on halfway: not streamed"
    assert stream.end() == text
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("name", ["plain", "aha", "bpe"])
def test_streamed_text_is_the_decoded_greedy_output_of_transformers_generate(models, name):
    model, tok = load(models[name])
    prompt = prompt_of(name, tok)
    pieces = []
    reply = generate(model, tok, prompt, max_new_tokens=STEPS, emit=pieces.append)
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False)
    ref = ref[0, len(prompt):]
    assert reply.ids == ref.tolist() and len(reply.ids) > 1
    assert "".join(pieces) == reply.text == tok.decode(ref, skip_special_tokens=True)
    assert reply.stats.prompt_tokens == len(prompt) and reply.stats.new_tokens == len(ref)
    assert (reply.stats.mu_f is not None) == (name == "aha")


# Cache and mu_f ---------------------------------------------------------------------------------------

def full_forward_gates(model, ids: list[int], first: int) -> tuple[int, int]:
    """(full gates, all gates) of positions first.. in one uncached forward over ids."""
    x = torch.tensor([ids])
    with torch.no_grad():
        if isinstance(model, allhere.Decoder):
            routing = model(x).routing
        else:
            model(x, use_cache=False)
            routing = allhere.hf.collect_routing(model)
    gates = [r.gates[..., first:] for r in routing.per_layer]
    return sum(int(g.sum()) for g in gates), sum(g.numel() for g in gates)


@pytest.mark.parametrize("name", ["plain", "aha", "ckpt"])
def test_cached_generation_equals_uncached_and_mu_f_counts_the_fed_back_tokens(models, name):
    model, tok = load(models[name])
    prompt = prompt_of(name, tok)
    cached = generate(model, tok, prompt, max_new_tokens=STEPS)
    uncached = generate(model, tok, prompt, max_new_tokens=STEPS, use_cache=False)
    assert cached.ids == uncached.ids and len(cached.ids) > 1
    if name == "plain":
        assert cached.stats.mu_f is None and not cached.stats.routed
        return
    s = cached.stats
    assert s.decode_steps == uncached.stats.decode_steps == len(cached.ids) - 1  # the last token is never fed
    assert (s.full_gates, s.gates) == (uncached.stats.full_gates, uncached.stats.gates)
    # the same gates as one forward over prompt + generated tokens but the last, at the generated positions
    assert (s.full_gates, s.gates) == full_forward_gates(model, prompt + cached.ids[:-1], len(prompt))
    assert 0 < s.mu_f < 1  # neutral routers: some gates open, some closed


@pytest.mark.parametrize("name", ["plain", "aha"])
def test_static_cache_gives_the_same_tokens_and_gates(models, name):
    """``--static-cache``: transformers' StaticCache instead of allhere's in-place cache, the same reply and, for
    AHA, the same gates counted."""
    model, tok = load(models[name])
    prompt = prompt_of(name, tok)
    default = generate(model, tok, prompt, max_new_tokens=STEPS)
    static = generate(model, tok, prompt, max_new_tokens=STEPS, static_cache=True)
    assert static.ids == default.ids and static.text == default.text
    s, d = static.stats, default.stats
    assert (s.decode_steps, s.full_gates, s.gates) == (d.decode_steps, d.full_gates, d.gates)


def test_static_cache_refusals(models, capsys):
    """An allhere checkpoint and a mechanism that reads only its own cache layouts are refused in one line."""
    code, out, err = run([f"--model={models['ckpt']}", "--prompt", "ab", "--static-cache"], capsys)
    assert code == 2 and not out and "not an allhere checkpoint" in err
    model, tok = load(models["plain"])
    allhere.hf.convert(model, allhere.SinksConfig(window=4, n_sinks=2))
    with pytest.raises(allhere.validation.ConfigError, match="does not decode over transformers' StaticCache"):
        generate(model, tok, prompt_of("plain", tok), max_new_tokens=2, static_cache=True)


@pytest.mark.parametrize("name", ["aha", "ckpt"])
def test_top_p_tiny_samples_the_argmax(models, name):
    model, tok = load(models[name])
    prompt = prompt_of(name, tok)
    greedy = generate(model, tok, prompt, max_new_tokens=STEPS)
    assert generate(model, tok, prompt, max_new_tokens=STEPS, temperature=1.0, top_p=1e-6).ids == greedy.ids


# The command ------------------------------------------------------------------------------------------

def test_checkpoint_prompt_streams_the_decoders_greedy_bytes(models, capsys):
    code, out, err = run(["--model", models["ckpt"], "--prompt", "héllo wörld", "--max-new-tokens", "20",
                          "--device", "cpu"], capsys)
    assert code == 0, err
    decoder, _ = load_model(models["ckpt"])
    prompt = list("héllo wörld".encode())
    ref = decoder.generate(torch.tensor([prompt]), 20)[0, len(prompt):].tolist()
    assert out == bytes(ref).decode("utf-8", errors="replace") + "\n"
    assert "20 tokens in" in err and "tokens/s" in err and "mu_f" in err and "over 19 decode steps" in err


def test_mu_f_is_reported_for_aha_only(models, capsys):
    for name in ("plain", "aha"):
        code, out, err = run(["--model", models[name], "--prompt", "w3 w1 w4 w1 w5 w9 w2 w6", "--max-new-tokens",
                              str(STEPS), "--device", "cpu"], capsys)
        assert code == 0, err
        model, tok = load(models[name])
        reply = generate(model, tok, prompt_of(name, tok), max_new_tokens=STEPS)
        assert out == reply.text + "\n"
        assert len(err.strip().splitlines()) == 1 and "tokens/s" in err
        if name == "aha":
            assert f"mu_f {100 * reply.stats.mu_f:.1f}% over {reply.stats.decode_steps} decode steps" in err
        else:
            assert "mu_f" not in err


def test_chat_over_stdin_keeps_the_conversation_in_the_template(models, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2 w3\n\nw4 w5 w6\n"))
    code, out, err = run(["--model", models["aha"], "--chat", "--max-new-tokens", "6", "--device", "cpu"], capsys)
    assert code == 0, err
    model, tok = load(models["aha"])
    assert not tok.chat_template  # so the command used the fallback, and said so
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    messages = []
    replies = list(chat(model, tok, ["w1 w2 w3", "", "w4 w5 w6"], messages=messages, max_new_tokens=6))
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[1::2]] == [r.text for r in replies]
    second = generate(model, tok, template_ids(tok, messages[:3]), max_new_tokens=6)
    assert second.ids == replies[1].ids  # the second reply continues the templated first exchange
    assert second.stats.prompt_tokens > len(template_ids(tok, messages[2:3]))
    assert out == "".join(r.text + "\n" for r in replies)
    lines = err.strip().splitlines()
    assert "fallback" in lines[0] and sum("tokens/s" in line for line in lines) == 2 and len(lines) == 3


def test_ctrl_c_in_a_chat_exits_130_with_one_line(models, capsys, monkeypatch):
    class CtrlC(io.StringIO):
        def readline(self, *args):
            if self.tell() > 0:  # the second line: the user presses Ctrl-C instead
                raise KeyboardInterrupt
            return super().readline(*args)

    monkeypatch.setattr(sys, "stdin", CtrlC("w1 w2 w3\n"))
    code, out, err = run(["--model", models["aha"], "--chat", "--max-new-tokens", "6", "--device", "cpu"], capsys)
    assert code == 130 and out.count("\n") == 2  # the reply's line, and the line ended on Ctrl-C
    assert err.strip().splitlines()[-1] == "allhere generate: interrupted"


def test_sampling_with_a_seed_repeats(models, capsys):
    argv = ["--model", models["bpe"], "--prompt", "ça va", "--temperature", "1.5", "--top-p", "0.9", "--seed", "7",
            "--max-new-tokens", "8", "--device", "cpu"]
    first, second = run(argv, capsys), run(argv, capsys)
    assert first[0] == 0 and first[1] == second[1]
    greedy = run(argv[:4] + argv[10:], capsys)
    assert greedy[0] == 0 and greedy[1] != first[1]


@pytest.mark.parametrize("name", ["plain", "ckpt"])
def test_generation_stops_at_an_end_token(models, name):
    model, tok = load(models[name])
    prompt = prompt_of(name, tok)
    greedy = generate(model, tok, prompt, max_new_tokens=STEPS).ids
    k = max(i for i in range(len(greedy)) if greedy[i] not in greedy[:i])  # the last first appearance
    end = greedy[k]
    if name == "plain":
        model.generation_config.eos_token_id = end
    else:
        tok.eos_token_id = end
    assert generate(model, tok, prompt, max_new_tokens=STEPS).ids == greedy[:k + 1]


def test_bad_input_is_one_line_and_exit_2(models, capsys):
    ckpt, plain = models["ckpt"], models["plain"]
    cases = [
        ([f"--model={plain}"], "one of the arguments --prompt --chat is required"),
        ([f"--model={plain}", "--prompt", "w1", "--chat"], "not allowed with argument"),
        ([f"--model={ckpt}", "--chat"], "--chat needs a chat template"),
        ([f"--model={plain}", "--prompt", "w1", "--temperature=-1"], "--temperature"),
        ([f"--model={plain}", "--prompt", "w1", "--temperature", "nan"], "'nan'"),
        ([f"--model={plain}", "--prompt", " "], "expected some text"),
        ([f"--model={plain}", "--prompt", "w1", "--top-p", "0.5"], "sampling settings"),
        ([f"--model={plain}", "--prompt", "w1", "--seed", "1"], "sampling settings"),
        ([f"--model={plain}", "--prompt", "w1", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompt", "w1"], "--model"),
    ]
    for argv, message in cases:
        code, out, err = run(argv, capsys)
        assert code == 2 and not out, (argv, out)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("allhere generate: error: ") and message in lines[0], (argv, err)


def test_a_checkpoint_that_is_not_byte_level_is_refused(tmp_path, capsys):
    path = tmp_path / "recall.safetensors"
    save_checkpoint(path, allhere.Decoder(allhere.ModelConfig(vocab_size=100, d_model=16, n_layers=1, n_heads=2)),
                    None, {"step": 0})
    code, out, err = run(["--model", str(path), "--prompt", "x", "--device", "cpu"], capsys)
    assert code == 2 and "byte-level" in err and len(err.strip().splitlines()) == 1
