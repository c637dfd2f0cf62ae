"""Cached decoding of a converted Hugging Face model: the cost per token as the context grows, with the
in-place cache layer converted models decode with (``allhere.hf.cache.InPlaceLayer``) against
transformers' ``DynamicLayer``, which concatenates the whole cache with the new token at every step.

    python benchmarks/hf_decode_cache.py                 # contexts 1k..16k, B = 1 and 8: ~2 minutes on 2 cores
    python benchmarks/hf_decode_cache.py --quick         # contexts 1k, 4k; B = 1

Model: a random-weight Llama (4 layers, d = 256, 4 heads of 64, fp32), converted with ``FullConfig`` (so
both columns run the same attention and differ only in the cache), and the same model unconverted (its
own SDPA attention with transformers' cache) for reference. Caches are filled to the context through
their layers' ``update`` with random keys and values (a decode step's cost does not depend on them).
Steps run round-robin (each configuration one step per round, the order rotating); medians over the
rounds; the machine's load (``os.getloadavg()``) is printed before and after.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from allhere import FullConfig
from allhere.hf import convert, new_cache
from allhere.hf.cache import cache_kwargs
from allhere_recipes.timing import round_robin_times


class ConcatLayer(DynamicLayer):
    """transformers' DynamicLayer as it is (a subclass only so that converted layers keep it)."""


def filled(cache, model, batch: int, context: int, steps: int):
    cfg = model.config
    shape = (batch, cfg.num_key_value_heads, context, cfg.hidden_size // cfg.num_attention_heads)
    for layer in cache.layers:
        if hasattr(layer, "_kv"):
            layer._kv.reserve(context + steps)
        layer.update(torch.randn(shape), torch.randn(shape))
    return cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts, batches = ([1024, 4096], [1]) if args.quick else ([1024, 2048, 4096, 8192, 16384], [1, 8])
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=32768, attn_implementation="sdpa")).eval()
    converted = convert(copy.deepcopy(plain), FullConfig())
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
          f"before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| B | context | in place (allhere) ms/token | concatenating (DynamicLayer) ms/token | ratio | "
          "unconverted model, transformers' cache ms/token |")
    print("|---|---|---|---|---|---|")
    for batch in batches:
        first = None
        for context in contexts:
            runs = {
                "in place": (converted, filled(new_cache(converted), converted, batch, context, args.rounds)),
                "concat": (converted, filled(Cache(layers=[ConcatLayer() for _ in range(4)]), converted,
                                             batch, context, args.rounds)),
                "unconverted": (plain, filled(DynamicCache(config=plain.config), plain, batch, context,
                                              args.rounds)),
            }
            token = torch.randint(0, 1000, (batch, 1))
            calls = {name: (lambda model=model, cache=cache: model(token, use_cache=True, **cache_kwargs(cache)))
                     for name, (model, cache) in runs.items()}
            with torch.inference_mode():
                times = round_robin_times(calls, args.rounds)
            ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            first = first or ms["in place"]
            print(f"| {batch} | {context} | {ms['in place']:.2f} ({ms['in place'] / first:.1f}x the first row) | "
                  f"{ms['concat']:.2f} | {ms['concat'] / ms['in place']:.2f}x | {ms['unconverted']:.2f} |")
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
