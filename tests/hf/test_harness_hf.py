"""`allhere eval` on a plain transformers model scores every request as lm-eval's own `hf` model (HFLM)
does: the same log-likelihoods and greedy flags, rolling log-likelihoods and greedy generations.

The model folders are built here, offline: a tiny random Llama with a byte-level BPE tokenizer (with a
BOS token added to every text, as Llama's; or with an EOS token only, as GPT-2's). Byte-level BPE makes
a trailing space of the context part of the continuation's first token, so scoring the context and the
continuation apart gives other tokens than lm-eval's whole-string encoding (checked below)."""

import random

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lm_eval.api.instance import Instance  # noqa: E402

WORDS = ("def class return self None True False import from as with for in range len print if else elif "
         "while yield lambda value key items list dict x y z total count index data name path").split()


def corpus(n: int, seed: int) -> str:
    """Python-like text without a period: rolling windows never repeat one another."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        lines.append(" " * rng.choice((0, 4, 8)) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7)))
                     + rng.choice((":", "", "()", " = []", "(self):", ", 1)")))
    return "\n".join(lines) + "\n"


def build_folder(path, bos: bool, dtype=torch.float32):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>"] if bos else ["<|endoftext|>"]
    # Only the characters of this text (no byte fragments): any token the model may pick decodes to text.
    text = [corpus(300, 1), "def __init__(self):\n    x = [1, 2]\n", "0123456789 []{}()<>:=+-*/.,;'\"!?_#\n\t",
            "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["bos", "eos-only", "bos-bf16"])
def pair(request, tmp_path_factory):
    """(HFLM, ours) on the same model folder, both with batches of 3; bf16: the checkpoint's dtype, which
    both load (lm-eval's default dtype "auto") and compute log-probabilities in."""
    from lm_eval.models.huggingface import HFLM

    from allhere.eval.harness import AllhereLM

    folder = build_folder(tmp_path_factory.mktemp(request.param), bos=request.param.startswith("bos"),
                          dtype=torch.bfloat16 if request.param.endswith("bf16") else torch.float32)
    hf = HFLM(pretrained=str(folder), device="cpu", batch_size=3)
    return hf, AllhereLM(str(folder), batch_size=3, show_progress=False)


def req(kind, *args):
    return Instance(kind, {}, args, 0, ("t", 0, 1))


def test_the_tokenizer_moves_trailing_spaces(pair):
    """The premise: here a context's trailing space changes the tokens, so a test of it can fail."""
    hf, _ = pair
    t = hf.tokenizer
    assert t.encode("x = []") != t.encode("x = ") + t.encode("[]", add_special_tokens=False)


def test_loglikelihood_matches_lm_eval(pair):
    hf, ours = pair
    bos = hf.tokenizer.bos_token or ""
    starts = ["def __init__(self", "x = [", "for i in range(", "import os\n"]
    greedy = hf.generate_until([req("generate_until", s, {"until": [], "max_gen_toks": 1}) for s in starts],
                               disable_tqdm=True)  # one token each: as a continuation, most are greedy
    long = corpus(20, 2)  # longer than max_length (64 tokens): cut from the left
    args = [("def __in", "it__(self):"), ("x = ", "[]"), ("x =  ", " [1, 2]"),
            ("for i in range(len(x)):\n    ", "total"), ("", "hello world"), (f"{bos}x = 1", " + 2"),
            (long, " return"), (long, corpus(2, 6)), *zip(starts, greedy),
            ("key", " value"), ("key", " values")]
    reqs = [req("loglikelihood", *a) for a in args]
    want = hf.loglikelihood(reqs, disable_tqdm=True)
    got = ours.loglikelihood(reqs)
    assert [g for _, g in got] == [g for _, g in want]
    assert any(g for _, g in want)  # a greedy continuation is among them
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-3)


def test_rolling_loglikelihood_matches_lm_eval(pair):
    hf, ours = pair
    texts = [corpus(12, 3), "short one", corpus(4, 4), ""]  # the first: several windows of 64 tokens
    reqs = [req("loglikelihood_rolling", t) for t in texts]
    want = hf.loglikelihood_rolling(reqs, disable_tqdm=True)
    assert ours.loglikelihood_rolling(reqs) == pytest.approx(want, abs=1e-3)


def test_greedy_generation_matches_lm_eval(pair):
    """Batches of prompts of different lengths (left padding), two groups of settings, stop strings that
    cut the answers, a prompt cut from the left to leave room for the new tokens (64 - 12)."""
    hf, ours = pair
    prompts = ["def __init__(self", "x", "for i in range(len(x)):\n    total", "import", corpus(20, 5), "class"]
    free = hf.generate_until([req("generate_until", p, {"until": [], "max_gen_toks": 12}) for p in prompts],
                             disable_tqdm=True)
    stops = [free[0][4:6], free[2][3:5]]  # strings the answers do contain
    reqs = [req("generate_until", p, {"until": stops, "max_gen_toks": 12}) for p in prompts]
    reqs += [req("generate_until", p, {"until": "\n", "max_gen_toks": 5}) for p in prompts[:4]]
    want = hf.generate_until(reqs, disable_tqdm=True)
    assert want[0] != free[0] and want[2] != free[2]  # the stops cut them
    assert ours.generate_until(reqs) == want


# Batches: equal to one request at a time, on the plain model and on the same model converted to AHA --------

@pytest.fixture(scope="module", params=["plain", "aha"])
def folder(request, tmp_path_factory):
    path = build_folder(tmp_path_factory.mktemp("plain"), bos=True)
    if request.param == "plain":
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from allhere import AHAConfig
    from allhere.hf import convert, save_pretrained

    out = tmp_path_factory.mktemp("aha")
    torch.manual_seed(1)  # the routers: about half the gates open, and a window of 4 tokens
    model = convert(AutoModelForCausalLM.from_pretrained(path), AHAConfig(window=4, router_init="neutral"))
    save_pretrained(model, out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def test_batches_equal_one_request_at_a_time(folder):
    """Batches of 4 (padded, longest first) give what batches of 1 give, in the requests' order; on the
    AHA model mu_f too, per task: it counts real tokens only."""
    from allhere.eval.harness import AllhereLM

    batched, single = (AllhereLM(str(folder), batch_size=n, show_progress=False) for n in (4, 1))
    seen = []
    inner = batched.runner.logprobs
    batched.runner.logprobs = lambda inputs, *a: seen.append([len(x) for x in inputs]) or inner(inputs, *a)
    ll = [Instance("loglikelihood", {}, (corpus(n, n), " return x"), i, ("ll", 0, 1))
          for i, n in enumerate((1, 4, 2, 12, 3, 1))]
    ll += [Instance("loglikelihood", {}, ("key", c), 9, ("ll", 0, 1)) for c in (" value", " values", " data")]
    roll = [Instance("loglikelihood_rolling", {}, (corpus(n, 10 + n),), i, ("roll", 0, 1))
            for i, n in enumerate((9, 1, 3))]
    gen = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 8}), i, ("gen", 0, 1))
           for i, p in enumerate(["def", corpus(2, 7), "x = [", corpus(4, 8), "import", "class A"])]
    got = [batched.loglikelihood(ll)]
    lengths = [n for call in seen for n in call]  # of the inputs of the loglikelihood batches
    got += [batched.loglikelihood_rolling(roll), batched.generate_until(gen)]
    want = single.loglikelihood(ll), single.loglikelihood_rolling(roll), single.generate_until(gen)
    assert [g for _, g in got[0]] == [g for _, g in want[0]]
    assert [s for s, _ in got[0]] == pytest.approx([s for s, _ in want[0]], abs=1e-4)
    assert got[1] == pytest.approx(want[1], abs=1e-4)
    assert got[2] == want[2]
    assert max(len(call) for call in seen) == 4
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 64  # longest first; cut to max_length
    if "aha" in str(folder):
        mu = batched.mu_f()
        assert set(mu) == {"ll", "roll", "gen"} and all(0.1 < m < 0.9 for m in mu.values())
        assert mu == pytest.approx(single.mu_f(), abs=1e-6)
    else:
        assert batched.mu_f() == {}
