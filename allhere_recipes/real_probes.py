"""What the real-model job measures of each model: held-out loss with AHA's usage per (layer, head), the long
tail of that usage, passkey retrieval, chat replies, and decode speed at a long prompt."""

from __future__ import annotations

import time

import torch

from allhere.eval import evaluate_lm
from allhere.hf import HFCausalLM

CHAT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the factorial of n.",
    "Give three tips for staying focused while studying.",
    "Explain what a Python list comprehension is, in two sentences.",
)


def heldout(model, windows: torch.Tensor, device: str, batch_size: int = 4) -> dict:
    """Held-out loss (nats/token), bits/token, mu_f and, for a routed model, its usage per layer and head."""
    out = evaluate_lm(HFCausalLM(model), windows, batch_size=batch_size, device=device)
    return {k: out[k] for k in ("loss", "bits_per_token", "mu_f", "usage") if k in out}


def long_tail(usage: list[list[float]], top: float = 0.1) -> dict:
    """How unevenly the global calls fall on the heads: the share of all global (token, head) pairs made by
    the busiest ``top`` of the heads, and the heads global on at least half of the tokens ("always-on")."""
    flat = sorted((u for row in usage for u in row), reverse=True)
    total = sum(flat)
    k = max(1, round(top * len(flat)))
    busiest = sum(flat[:k]) / total if total else 0.0
    return {"heads": len(flat), "top_share": top, "busiest_heads": k, "busiest_share_of_global_calls": busiest,
            "heads_global_half_the_time": sum(u >= 0.5 for u in flat),
            "heads_never_global": sum(u == 0.0 for u in flat)}


def chat_replies(model, tokenizer, new_tokens: int) -> list[str]:
    """Greedy replies to ``CHAT_PROMPTS``, each alone in a conversation, through the tokenizer's chat template."""
    from allhere.generation import generate, template_ids

    return [generate(model, tokenizer, template_ids(tokenizer, [{"role": "user", "content": p}]),
                     max_new_tokens=new_tokens).text.strip() for p in CHAT_PROMPTS]


def long_prompt(docs: list[torch.Tensor], tokens: int) -> torch.Tensor:
    """``tokens`` tokens of held-out text: the validation documents, longest first, joined. [1, tokens]"""
    ids = torch.cat(docs)[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than the {tokens} of the speed prompt")
    return ids.unsqueeze(0)


def _caches(model, reserve: int) -> dict:
    """The caches a decode of ``model`` runs on, by name: a converted model's own (``allhere.hf.new_cache``, what
    ``allhere generate`` uses); a plain one's transformers default and allhere's in-place layers."""
    from transformers.cache_utils import Cache, DynamicCache

    from allhere.hf import new_cache
    from allhere.hf.cache import InPlaceLayer
    from allhere.mechanisms.base import mechanism_layers

    if mechanism_layers(model):
        return {"in place (allhere.hf.new_cache)": lambda: new_cache(model, reserve=reserve)}

    def in_place():
        cache = Cache(layers=[InPlaceLayer() for _ in range(model.config.num_hidden_layers)])
        for layer in cache.layers:
            layer.reserve(reserve)
        return cache

    return {"DynamicCache (transformers' default)": lambda: DynamicCache(config=model.config),
            "in place (allhere InPlaceLayer)": in_place}


@torch.inference_mode()
def decode_speed(model, ids: torch.Tensor, new_tokens: int, device: str) -> list[dict]:
    """Per cache of ``model``: the prefill of ``ids`` [1, n] (seconds) and the median decode step after it
    (``generate``, greedy, ``new_tokens`` steps timed after two untimed ones), with mu_f of the timed steps."""
    from allhere.hf.cache import cache_kwargs
    from allhere.routing import routed_layers

    from .generate_bench import decode_steps

    rows = []
    ids = ids.to(device)
    for name, make in _caches(model, ids.shape[1] + new_tokens + 4).items():
        cache = make()
        start = time.perf_counter()
        model(ids[:, :-1], use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        prefill = time.perf_counter() - start
        steps, _, shares = decode_steps(model, ids, cache, new_tokens, 2, routed=bool(routed_layers(model)))
        ms = 1e3 * sorted(steps)[len(steps) // 2]
        rows.append({"cache": name, "prompt_tokens": ids.shape[1], "prefill_s": prefill, "ms_per_step": ms,
                     "tokens_per_s": 1e3 / ms, "steps": len(steps), "mu_f": None if shares is None else shares[0],
                     "kv_heads_global": None if shares is None else shares[1]})
    return rows
