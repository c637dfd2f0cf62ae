"""KV-cache bytes of DAR (latents + rolling window) against the vanilla cache, for the same model.

    python benchmarks/dar_cache_memory.py     # d = 1024, 16 heads (MHA), d_down = d/4, w = 128, fp16

The caches are filled through their own ``update`` with tensors of the real shapes (no attention is
computed), and the bytes of what they keep are counted (``used_nbytes``: the spare room of their
in-place buffers is not): one layer, batch 1. The DAR cache also holds the
absorbed weights W_K W_up and W_V W_up (a constant per layer, counted). With transformers installed, a
last column counts the cache layer a converted Hugging Face model decodes with (``allhere.hf.cache``:
no absorbed weights, one int32 position per token), filled the same way.
"""

from __future__ import annotations

import argparse

import torch

from allhere.mechanisms.dar import cache_bytes


def hf_layer_bytes(tokens: int, kv_heads: int, head_dim: int, d_down: int, window: int, dtype,
                   chunk: int = 4096) -> int | None:
    """Bytes ``allhere.hf.cache.DARCacheLayer`` keeps after ``tokens`` tokens; None without transformers."""
    try:
        from allhere.hf.cache import DARCacheLayer
    except ImportError:
        return None
    layer = DARCacheLayer(window)
    for done in range(0, tokens, chunk):
        k = torch.zeros(1, kv_heads, min(chunk, tokens - done), head_dim, dtype=dtype)
        layer.update(k, k.clone())
        layer.add_latents(torch.zeros(1, k.shape[2], d_down, dtype=dtype), None)
    return layer.used_nbytes()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    a = p.parse_args(argv)
    kv = a.kv_heads or a.heads
    d_down = a.d_model // 4
    print(f"# one layer, batch 1, fp16, d={a.d_model}, heads={a.heads}, kv_heads={kv}, d_down={d_down}, w={a.window}")
    print("| T | vanilla cache | DAR cache | DAR / vanilla | DAR, HF cache layer |")
    print("|---|---|---|---|---|")
    for t in a.tokens:
        dar, van = cache_bytes(t, a.d_model, a.heads, kv, d_down, a.window, torch.float16)
        hf = hf_layer_bytes(t, kv, a.d_model // a.heads, d_down, a.window, torch.float16)
        hf = "n/a" if hf is None else f"{hf / 2**20:.2f} MiB ({100 * hf / van:.1f}%)"
        print(f"| {t} | {van / 2**20:.1f} MiB | {dar / 2**20:.2f} MiB | {100 * dar / van:.1f}% | {hf} |")


if __name__ == "__main__":
    main()
