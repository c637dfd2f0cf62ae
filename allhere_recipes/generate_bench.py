"""Decode steps of a transformers model through its own ``generate``, timed step by step on a cache that
already holds a long context (part of ``allhere bench --tables model``, ``llama_bench``).

A long context's prefill takes longer than the steps measured after it, and says nothing about them: the
caches are filled instead with the model's own keys and values of a short prompt, repeated to the context
length (``seed_kv``, ``fill``). ``generate`` then continues the batch: it feeds the one token the cache
lacks, then its new tokens, one step each; a logits processor stamps the end of every step's forward, so
the steps are timed without the warm-up and without what ``generate`` does before its first step.
"""

from __future__ import annotations

import time

import torch


def seed_kv(model, tokens: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys and values [1, kv_heads, tokens, head_dim] of a random prompt of ``tokens``."""
    from transformers.cache_utils import DynamicCache

    from allhere.hf.cache import cache_kwargs

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids.to(device), use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def fill(cache, seed, batch: int, context: int):
    """``cache`` (empty) holding ``context`` tokens of every one of ``batch`` rows: the ``seed`` keys and
    values repeated, written through each layer's own ``update`` (as a prefill writes them)."""
    with torch.inference_mode():
        for layer, (k, v) in zip(cache.layers, seed):
            reps = -(-context // k.shape[2])
            tile = lambda t: t.repeat(batch, 1, reps, 1)[:, :, :context].contiguous()  # noqa: E731
            layer.update(tile(k), tile(v))
    return cache


def _step_clock(device: str):
    """A transformers logits processor that stamps the time at each call (after each step's forward)."""
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    return StepClock()


def global_shares(routing, kv_heads: int) -> tuple[float, float]:
    """(mu_f, the share of (row, layer, KV head) whose group of query heads has a global one) of a decode
    step's routing: with grouped-query attention a KV head's whole cache is read when any of its query
    heads is global."""
    gates = torch.stack([layer.gates[..., -1] for layer in routing.per_layer])  # [layers, b, heads]
    grouped = gates.reshape(*gates.shape[:2], kv_heads, -1)
    return float(gates.float().mean()), float(grouped.any(-1).float().mean())


def decode_steps(model, ids: torch.Tensor, cache, new_tokens: int, warmup_tokens: int, routed: bool = False):
    """(seconds of each timed step, the sequences so far, ``global_shares`` of the warm-up steps or None):
    ``generate`` continues ``ids`` [batch, cached + 1] on ``cache`` for ``warmup_tokens`` (untimed; with
    ``routed`` the routing of their steps is read there), then ``new_tokens`` whose steps are timed, greedy,
    ``new_tokens - 1`` intervals."""
    from transformers import LogitsProcessorList

    from allhere.hf.cache import cache_kwargs

    settings = dict(do_sample=False, pad_token_id=0, num_beams=1, **cache_kwargs(cache))
    mus = []
    hook = None
    if routed:
        from allhere.hf import collect_routing

        kv = model.config.num_key_value_heads
        hook = model.register_forward_hook(lambda *_: mus.append(global_shares(collect_routing(model), kv)))
    try:
        with torch.inference_mode():
            ids = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=warmup_tokens, min_new_tokens=warmup_tokens, **settings)
    finally:
        if hook is not None:
            hook.remove()
    clock = _step_clock(str(ids.device))
    with torch.inference_mode():
        ids = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             logits_processor=LogitsProcessorList([clock]), **settings)
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return steps, ids, (tuple(sum(m[i] for m in mus) / len(mus) for i in range(2)) if mus else None)
