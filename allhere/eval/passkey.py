"""Passkey retrieval: a five-digit number hidden in filler text, asked for at the end (the test of "Landmark
Attention", Mohtashami and Jaggi, arXiv:2305.16300). The filler says nothing about the key, so a model can
answer only by attending back to where the key was said: at a distance beyond an AHA model's window, only a
head on full attention reads it.

Each prompt has exactly ``length`` tokens (the filler is cut to fit); the key sentence ends ``distance``
tokens before the prompt's end. The answer is read greedily: correct when the first number of the reply is
the key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..validation import ConfigError

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]  # the prompt's token ids, ``length`` of them
    key: str  # the five digits asked for
    distance: int  # tokens from the end of the key sentence to the end of the prompt


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def passkey_prompts(tokenizer, count: int, length: int, min_distance: int, seed: int = 0) -> list[PasskeyPrompt]:
    """``count`` prompts of ``length`` tokens, each with a random five-digit key whose sentence ends between
    ``min_distance`` tokens before the end (at least the question's length) and as far back as the prompt
    allows (spread evenly over that range, in random order). The intro is tokenized with the tokenizer's
    special tokens (a beginning-of-sequence token where it adds one)."""
    intro, question = _encode(tokenizer, INTRO, special=True), _encode(tokenizer, QUESTION)
    filler = _encode(tokenizer, FILLER * (length // 8 + 2))  # more than any prompt needs
    rng = random.Random(seed)
    keys = [str(rng.randint(10000, 99999)) for _ in range(count)]
    key_len = max(len(_encode(tokenizer, KEY.format(key=k))) for k in keys)
    longest = length - len(intro) - key_len  # the key sentence right after the intro
    min_distance = max(min_distance, len(question))
    if longest < min_distance:
        raise ConfigError(f"passkey prompts of {length} tokens cannot hold a key {min_distance} tokens before the "
                          f"end (at most {longest})")
    distances = [min_distance + round(i * (longest - min_distance) / max(1, count - 1)) for i in range(count)]
    rng.shuffle(distances)
    prompts = []
    for key, distance in zip(keys, distances):
        sentence = _encode(tokenizer, KEY.format(key=key))
        after = filler[: distance - len(question)]
        before = filler[: length - len(intro) - len(sentence) - len(after) - len(question)]
        ids = intro + before + sentence + after + question
        prompts.append(PasskeyPrompt(ids, key, distance))
    return prompts


def answer_of(text: str) -> str | None:
    """The first run of digits in a reply, or None."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


@torch.no_grad()
def passkey_accuracy(model, tokenizer, prompts: list[PasskeyPrompt], new_tokens: int = 8,
                     done: Callable[[], None] | None = None) -> dict:
    """Greedy answers of ``model`` (a transformers causal LM, plain or converted) to ``prompts``: accuracy, mu_f
    over the answers' decode steps, over the question's tokens (``QUESTION``, the prompt's last tokens: where the
    model must decide to read the key) and over every prompt token (routed models; None otherwise), and each
    prompt's distance, key and answer. ``done()`` is called after each prompt (a progress bar)."""
    from ..generation import generate

    question = len(_encode(tokenizer, QUESTION))
    rows, full, gates, asked, read = [], 0, 0, [], []
    for p in prompts:
        out = generate(model, tokenizer, p.ids, max_new_tokens=new_tokens)
        rows.append({"distance": p.distance, "key": p.key, "answer": answer_of(out.text)})
        full, gates = full + out.stats.full_gates, gates + out.stats.gates
        if out.stats.prompt_mu_f is not None:
            asked += out.stats.prompt_mu_f[-question:]
            read += out.stats.prompt_mu_f
        if done is not None:
            done()
    correct = sum(r["answer"] == r["key"] for r in rows)
    return {"accuracy": correct / len(rows), "correct": correct, "prompts": len(rows),
            "mu_f": full / gates if gates else None,
            "question_mu_f": sum(asked) / len(asked) if asked else None,
            "prompt_mu_f": sum(read) / len(read) if read else None, "rows": rows}
