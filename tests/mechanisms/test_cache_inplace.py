"""KV caches written in place (``allhere.mechanisms.caches``, ``DARCache``, ``DARCacheLayer``): decoding with
them equals the uncached forward for every mechanism that has a cache, under ``no_grad`` and
``inference_mode``, long enough for buffers to grow, windows to move and patterns to compact; a decode
step writes into the buffer without copying it (same ``data_ptr``) and N tokens cost O(log N)
reallocations; autograd and the switch between modes still work."""

import math

import pytest
import torch

from allhere import (
    AHAConfig,
    DARConfig,
    Decoder,
    FullConfig,
    ModelConfig,
    SlidingConfig,
)
from allhere.mechanisms import (
    AAMoEConfig,
    AllAttentionConfig,
    BigBirdConfig,
    DilatedConfig,
    LongformerConfig,
    SinksConfig,
)
from allhere.mechanisms.caches import GRAIN, KVCache, PatternKVCache, RollingKVCache
from allhere.mechanisms.dar import DARCache

from helpers import rel_err

MECHS = {
    "full": FullConfig(),
    "sliding": SlidingConfig(window=5),
    "aha": AHAConfig(window=4, router_init="neutral"),
    "dar": DARConfig(window=4, d_down=8),
    "dar-w0": DARConfig(window=0, d_down=8),
    "sinks": SinksConfig(window=6, n_sinks=2),
    "dilated": DilatedConfig(window=3, dilation=(1, 2, 3, 1)),
    "longformer": LongformerConfig(window=3, dilation=2, global_first=2, global_positions=(9,)),
    "bigbird": BigBirdConfig(block=2, window_blocks=2, global_blocks=1, random_blocks=1, seed=1),
    "allattention": AllAttentionConfig(n_mem=4),
    "aamoe": AAMoEConfig(chunk=3, experts=2, budget=1.5),
}
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
N = 150  # tokens: KVCache grows 64 -> 128 -> 256, the window moves, the patterns compact


def tiny(mech):
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mechanism=mech)).eval()


CASES = ([(name, "no_grad") for name in MECHS]
         + [(name, "inference_mode") for name in ("full", "sliding", "dar", "sinks")])


@pytest.mark.parametrize("name,mode", CASES)
def test_cached_decoding_in_place_equals_full_forward(name, mode):
    model = tiny(MECHS[name])
    n = 70 if name in ("aamoe", "allattention") else N  # every key kept, as "full": one growth is enough
    ids = torch.randint(0, 61, (2, n), generator=torch.Generator().manual_seed(1))
    with MODES[mode]():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, t:t + 1], cache=cache) for t in range(n)]
        assert rel_err(torch.cat([s.logits for s in steps], 1), full.logits) < 1e-5
        if full.routing is not None:  # AHA: the same gates, token by token
            gates = torch.cat([s.routing.per_layer[0].gates for s in steps], dim=2)
            assert torch.equal(gates, full.routing.per_layer[0].gates)
        cache = model.new_cache()  # a prefill, chunks, then tokens
        cuts = [(0, n - 40), (n - 40, n - 35), (n - 35, n - 33)] + [(t, t + 1) for t in range(n - 33, n)]
        parts = torch.cat([model(ids[:, a:b], cache=cache).logits for a, b in cuts], 1)
        assert rel_err(parts, full.logits) < 1e-5


@pytest.mark.parametrize("name", ["full", "sliding", "aha", "dar", "sinks", "dilated", "longformer", "bigbird"])
def test_greedy_generation_with_the_cache_equals_without(name):
    model = tiny(MECHS[name])
    prompt = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 60)  # the cache, in place (generate runs under no_grad)
    ids = prompt
    with torch.no_grad():
        for _ in range(60):  # no cache: the whole sequence each step
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, ids)


def test_kv_cache_writes_in_place_and_reallocates_log_n_times():
    cache, n = KVCache(), 5000
    k = torch.randn(2, 3, n, 8)
    ptrs = set()
    with torch.no_grad():
        for t in range(n):
            before, cap = cache.capacity, cache.capacity
            k_all, v_all = cache.update(k[:, :, t:t + 1], -k[:, :, t:t + 1])
            if t + 1 <= before:  # room left: the same buffer, nothing copied but the new token
                assert cache.capacity == cap and cache._k.data.data_ptr() in ptrs
            ptrs.add(cache._k.data.data_ptr())
            assert k_all.data_ptr() == cache._k.data.data_ptr()  # a view of the buffer
    assert torch.equal(k_all, k) and torch.equal(v_all, -k) and len(cache) == n
    assert cache.reallocations == len(ptrs) <= math.ceil(math.log2(n / GRAIN)) + 1  # 64, 128, ..., 8192
    assert cache.capacity < 2 * n
    assert cache.used_nbytes() == 2 * k.numel() * 4 and cache.nbytes() == 2 * 2 * 3 * cache.capacity * 8 * 4


def test_reserve_allocates_once_and_a_held_view_keeps_its_values():
    cache = KVCache()
    cache.reserve(300)
    k = torch.randn(1, 2, 300, 4)
    with torch.no_grad():
        first, _ = cache.update(k[:, :, :100], k[:, :, :100])
        kept = first.clone()
        for t in range(100, 300):
            cache.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
    assert cache.reallocations == 1 and cache.capacity == 320
    assert torch.equal(first, kept)  # appends write after the views returned before, never inside them


def test_rolling_cache_keeps_its_buffer_and_returns_positions_in_order():
    w, n = 32, 1000
    cache = RollingKVCache(w)
    k = torch.randn(1, 2, n, 4)
    with torch.no_grad():
        cache.update(k[:, :, :10], k[:, :, :10])
        ptr = cache._k.data_ptr()
        for t in range(10, n):
            first = cache.dropped
            k_all, _ = cache.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
            assert torch.equal(k_all, k[:, :, first:t + 1]) and k_all.shape[2] == min(w, t) + 1
            assert cache._k.data_ptr() == ptr and len(cache) == min(w, t + 1)
        # once per slack tokens
        assert (n - 10) // (cache.slack + 1) <= cache.moves <= (n - 10) // (cache.slack - 1) + 1
        big = torch.randn(1, 2, 200, 4)  # more than the buffer holds: a fresh tensor, the buffer kept
        k_all, _ = cache.update(big, big)
    assert torch.equal(k_all, torch.cat([k[:, :, n - w:], big], 2)) and cache._k.data_ptr() == ptr
    assert torch.equal(cache.k, big[:, :, -w:]) and cache.dropped == n + 200 - w
    assert cache.nbytes() == 2 * 2 * (w + cache.slack) * 4 * 4 and cache.used_nbytes() == 2 * 2 * w * 4 * 4


@pytest.mark.parametrize("prefill", [1, 500])
def test_pattern_cache_drops_lazily_and_compacts_amortised(prefill):
    span, sinks, n = 40, 3, 3000
    cache = PatternKVCache(span, fixed=lambda pos: pos < sinks)
    k = torch.randn(1, 2, n, 4)
    with torch.no_grad():
        cache.update_at(k[:, :, :prefill], k[:, :, :prefill])
        assert cache.held == len(cache) == min(prefill, span + sinks)
        ptr, compactions = cache._k.data_ptr(), cache.compactions
        for t in range(prefill, n):
            k_all, _, pos = cache.update_at(k[:, :, t:t + 1], k[:, :, t:t + 1])
            assert torch.equal(k_all, k[:, :, pos]) and pos[-1] == t and bool((pos[1:] > pos[:-1]).all())
            p = torch.arange(t + 1)
            need = p[(p < sinks) | (t - p < span)]
            assert bool(torch.isin(need, pos).all())  # every key the pattern reads is there
            if cache.compactions == compactions:
                assert cache._k.data_ptr() == ptr  # written in place between compactions
            ptr, compactions = cache._k.data_ptr(), cache.compactions
    assert len(cache) == span + sinks and cache.held <= cache.capacity <= 2 * GRAIN
    assert cache.compactions <= n // GRAIN + 3  # each compaction frees at least GRAIN slots
    cache.compact()
    assert cache.held == len(cache)


def test_dar_cache_latents_grow_in_place():
    cache, n = DARCache(4), 600
    with torch.no_grad():
        for t in range(n):
            k = torch.full((1, 2, 1, 8), float(t))
            k_near, _, latents = cache.update(k, k, torch.full((1, 1, 3), float(t)))
            assert torch.equal(k_near[0, 0, :, 0], torch.arange(max(0, t - 4), t + 1).float())
            assert latents.shape == (1, t + 1, 3) and latents[0, -1, 0] == t
    assert torch.equal(cache.latent[0, :, 0], torch.arange(n).float())
    assert cache._latent.reallocations <= math.ceil(math.log2(n / GRAIN)) + 1
    assert cache.used_nbytes() == 2 * 4 * 2 * 8 * 4 + n * 3 * 4 and cache.nbytes() >= cache.used_nbytes()


def test_autograd_records_out_of_place_and_no_grad_continues():
    """While autograd records, a backward through several cached steps works (nothing saved was written in
    place) and reaches every step's keys; then decoding under no_grad continues in a buffer of its own."""
    for cache in (KVCache(), RollingKVCache(3), PatternKVCache(3, fixed=lambda p: p < 1)):
        ks = [torch.randn(1, 1, 1, 4, requires_grad=True) for _ in range(6)]
        loss = 0
        for k in ks:
            out = cache.update(k, k * 2)
            loss = loss + out[0].sum() + out[1].sum()
        loss.backward()
        assert all(k.grad is not None for k in ks)
        with torch.no_grad():
            extra = torch.randn(1, 1, 1, 4)
            if isinstance(cache, PatternKVCache):
                k_all, _, pos = cache.update_at(extra, extra)
            else:
                k_all, _ = cache.update(extra, extra)
                pos = torch.arange(7)[-k_all.shape[2]:]
        every = torch.cat([*(k.detach() for k in ks), extra], 2)
        assert torch.equal(k_all, every[:, :, pos]) and not k_all.requires_grad


def test_inference_mode_buffers_continue_under_no_grad():
    for cache in (KVCache(), RollingKVCache(3), PatternKVCache(3, fixed=lambda p: p < 1)):
        k = torch.randn(1, 1, 10, 4)
        with torch.inference_mode():
            for t in range(5):
                cache.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
        with torch.no_grad():
            for t in range(5, 10):
                k_all, _ = cache.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
        assert torch.equal(k_all[:, :, -1:], k[:, :, 9:]) and not k_all.is_inference()


def test_hf_dar_cache_layer_in_place_and_reorder():
    pytest.importorskip("transformers")
    from allhere.hf.cache import DARCacheLayer

    layer, w = DARCacheLayer(3), 3
    k = torch.randn(2, 2, 200, 4)
    with torch.no_grad():
        layer.update(k[:, :, :5], k[:, :, :5])
        layer.add_latents(k[:, 0, :5, :3], None)
        ptr = layer._near._k.data_ptr()
        for t in range(5, 200):
            keys, _ = layer.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
            latents = layer.add_latents(k[:, 0, t:t + 1, :3], None)
            assert torch.equal(keys, k[:, :, t - w:t + 1]) and torch.equal(latents, k[:, 0, :t + 1, :3])
        assert layer._near._k.data_ptr() == ptr and layer.keys.shape[2] == w
        layer.reorder_cache(torch.tensor([1, 1]))
        assert torch.equal(layer.keys, k[[1, 1], :, -w:]) and torch.equal(layer.latent, k[[1, 1], 0, :, :3])
        assert torch.equal(layer.positions, torch.arange(200, dtype=torch.int32).expand(2, -1))
        layer.batch_select_indices(torch.tensor([0]))
        keys, _ = layer.update(k[1:, :, :1], k[1:, :, :1])
    assert keys.shape == (1, 2, w + 1, 4) and torch.equal(keys[:, :, :w], k[1:, :, -w:])
    assert layer.get_seq_length() == 201 and layer.used_nbytes() < layer.nbytes()


def test_decode_speed_benchmark_smoke():
    """benchmarks/decode_speed.py runs end to end with tiny sizes (it measures nothing here)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = ["--contexts", "64", "128", "--batches", "1", "2", "--layers", "2", "--d-model", "32", "--heads", "2",
            "--vocab", "64", "--b-context", "320", "--b-batch", "2", "--b-d-model", "64", "--b-heads", "4",
            "--window", "16", "--rounds", "1", "--cat"]
    done = subprocess.run([sys.executable, "benchmarks/decode_speed.py", *args], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert all(f"## ({p})" in out for p in "abc") and "load average before" in out and "load average after" in out
    assert out.count("| 2 | 128 |") == 1 and "| AHA w=16, torch.cat cache |" in out and "mu_f of the AHA steps" in out
