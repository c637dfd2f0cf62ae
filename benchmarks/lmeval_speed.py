"""lm-eval speed: `allhere eval`'s model class (`allhere.eval.harness.AllhereLM`) against lm-eval's own
`hf` model (`HFLM`), on the same plain transformers model, in one run.

    python benchmarks/lmeval_speed.py                    # Llama d 256, 4 layers, BPE vocab 8192, CPU
    python benchmarks/lmeval_speed.py --tiny --rounds 1 --requests 8   # a smoke test of the script

Builds its model folders offline in a temporary folder: a byte-level BPE tokenizer trained with
`tokenizers` on the interpreter's standard library, a random Llama saved with it, and the same Llama
converted to AHA (routers at random, about half the gates open). Requests are spans of the same source
files. Each workload runs on each model in turn, round-robin, the order rotating every round, so that the
load of a shared machine falls on all of them alike; requests/s are over all rounds. Prints one Markdown
table with the ratios ours / HFLM, mu_f of the AHA model, and the machine's load before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

from allhere_recipes.timing import timed_call


def corpus(limit_bytes: int) -> list[str]:
    """Source files of the standard library, sorted by path, up to ``limit_bytes`` in all."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return files


def build_folders(root: Path, tiny: bool, window: int, texts: list[str]) -> tuple[Path, Path]:
    """(plain Llama folder, the same converted to AHA) with a BPE tokenizer trained on ``texts``."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from allhere import AHAConfig
    from allhere.hf import convert, save_pretrained

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512 if tiny else 8192, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    d, layers = (64, 2) if tiny else (256, 4)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    plain, aha = root / "plain", root / "aha"
    model.save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    save_pretrained(convert(model, AHAConfig(window=window, router_init="neutral")), aha)
    tokenizer.save_pretrained(aha)
    return plain, aha


def workloads(tokenizer, texts: list[str], n: int, gen_tokens: int, seed: int = 0) -> dict[str, list]:
    """Requests cut from the token stream of ``texts``: contexts of 20-60 and of 100-400 tokens with 1-8
    continuation tokens; prompts of 20-60 tokens for generation."""
    from lm_eval.api.instance import Instance

    ids = tokenizer("".join(texts), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)

    def span(lo, hi):
        n_ctx = rng.randint(lo, hi)
        start = rng.randrange(len(ids) - n_ctx - 8)
        end = start + n_ctx + rng.randint(1, 8)
        return tokenizer.decode(ids[start:start + n_ctx]), tokenizer.decode(ids[start + n_ctx:end])

    def ll(lo, hi):
        return [Instance("loglikelihood", {}, span(lo, hi), i, ("bench", 0, 1)) for i in range(n)]

    gen = {"until": ["\n\n"], "max_gen_toks": gen_tokens, "do_sample": False}
    return {"loglikelihood, contexts of 20-60 tokens": ll(20, 60),
            "loglikelihood, contexts of 100-400 tokens": ll(100, 400),
            f"generate_until, {gen_tokens} new tokens": [Instance("generate_until", {}, (span(20, 60)[0], gen), i,
                                                                  ("bench", 0, 1)) for i in range(n)]}


def call(lm, kind: str, reqs) -> None:
    if kind.startswith("loglikelihood"):
        lm.loglikelihood(reqs)
    else:
        lm.generate_until(reqs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer d 64 model and a 512-token vocabulary (smoke test)")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds (default 3)")
    p.add_argument("--requests", type=int, default=96, help="requests per workload and round (default 96)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size of both (default 16)")
    p.add_argument("--gen-tokens", type=int, default=32, help="new tokens per generation request (default 32)")
    p.add_argument("--window", type=int, default=64, help="AHA window of the converted model (default 64)")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as lm-eval's own command line sets it
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from lm_eval.models.huggingface import HFLM

    from allhere.eval.harness import AllhereLM

    load_before = os.getloadavg()
    texts = corpus(300_000 if a.tiny else 3_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        plain, aha = build_folders(Path(tmp), a.tiny, a.window, texts)
        models = {"HFLM": HFLM(pretrained=str(plain), device="cpu", batch_size=a.batch_size),
                  "ours": AllhereLM(str(plain), batch_size=a.batch_size, show_progress=False),
                  "ours, AHA": AllhereLM(str(aha), batch_size=a.batch_size, show_progress=False)}
        for lm in models.values():
            if isinstance(lm, HFLM):  # lm-eval's bars off; ours are off already
                for name in ("loglikelihood", "generate_until"):
                    setattr(lm, name, (lambda f: lambda reqs: f(reqs, disable_tqdm=True))(getattr(lm, name)))
        work = workloads(models["ours"].runner.tok, texts, a.requests, a.gen_tokens)
        warm = workloads(models["ours"].runner.tok, texts, 4, 4, seed=1)
        for kind, reqs in warm.items():
            for lm in models.values():
                call(lm, kind, reqs)
        seconds = {(m, k): 0.0 for m in models for k in work}
        names = list(models)
        for r in range(a.rounds):
            for kind, reqs in work.items():
                for m in names[r % len(names):] + names[:r % len(names)]:
                    seconds[m, kind] += timed_call(lambda: call(models[m], kind, reqs))[1]
        mu = models["ours, AHA"].mu_f().get("bench")
    load_after = os.getloadavg()

    per_s = {key: a.rounds * a.requests / s for key, s in seconds.items()}
    params = sum(t.numel() for t in models["ours"].runner.model.parameters())
    print(f"# {params / 1e6:.1f}M-parameter Llama (vocab {models['ours'].runner.model.config.vocab_size}), batch "
          f"{a.batch_size}, {a.rounds} rounds x {a.requests} requests per workload, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"# load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.2f}' for x in load_after)}")
    print("| workload | HFLM req/s | ours req/s | ours / HFLM | ours, AHA req/s | AHA / HFLM |")
    print("|---|---|---|---|---|---|")
    for kind in work:
        h, o, x = per_s["HFLM", kind], per_s["ours", kind], per_s["ours, AHA", kind]
        print(f"| {kind} | {h:.1f} | {o:.1f} | {o / h:.2f}x | {x:.1f} | {x / h:.2f}x |")
    print(f"AHA model (w={a.window}, routers at random): mu_f {mu:.3f} over every real token it read" if mu is not None
          else "AHA model: no mu_f recorded")


if __name__ == "__main__":
    main()
