"""DAR on Hugging Face models, offline: tiny random-weight configs (the families of test_hf), no downloads.
The compressed KV cache (rolling full K/V + latents, inside transformers' Cache API) is checked against
uncached forwards and generations."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhere import ConfigError, DARConfig  # noqa: E402
from allhere.hf import (  # noqa: E402
    cache_nbytes,
    convert,
    load_pretrained,
    new_cache,
    save_pretrained,
)
from allhere.hf.cache import DARCacheLayer, cache_kwargs  # noqa: E402

from helpers import rel_err  # noqa: E402
from test_hf import FAMILIES, build  # noqa: E402


@pytest.mark.parametrize("name", FAMILIES)
def test_no_bottleneck_or_wide_window_equals_original(name):
    ids = torch.randint(3, 97, (2, 24))
    with torch.no_grad():
        ref = build(name)(ids).logits
        same = convert(build(name), DARConfig(window=4, d_down=64))(ids).logits  # d_down = d: h' = h
        wide = convert(build(name), DARConfig(window=24, d_down=8))(ids).logits  # every key is near
        dar = convert(build(name), DARConfig(window=4, d_down=8))(ids).logits
    assert rel_err(same, ref) < 1e-5 and rel_err(wide, ref) < 1e-5
    assert rel_err(dar[:, :4], ref[:, :4]) < 1e-5  # the first w tokens see only near keys
    assert rel_err(dar, ref) > 1e-3


def fold_bottleneck(model, plain):
    """Give ``plain`` (the original model) K/V projections W_K W_up W_down, W_V W_up W_down from ``model``'s
    bottlenecks: run by transformers itself, it is then an oracle for uniform reduction (w = 0)."""
    from allhere.hf.convert import attention_modules

    for attn, target in zip(attention_modules(model), attention_modules(plain)):
        fold = attn.allhere.up.weight @ attn.allhere.down.weight  # [d, d]: h -> h'
        with torch.no_grad():
            if hasattr(target, "query_key_value"):  # GPT-NeoX: per head rows [q | k | v]
                heads = model.config.num_attention_heads
                w = target.query_key_value.weight.view(heads, 3, -1, fold.shape[0])
                w[:, 1:] = w[:, 1:] @ fold
            else:
                target.k_proj.weight.copy_(target.k_proj.weight @ fold)
                target.v_proj.weight.copy_(target.v_proj.weight @ fold)


@pytest.mark.parametrize("name", FAMILIES)
def test_uniform_reduction_equals_transformers_with_folded_projections(name):
    model = convert(build(name), DARConfig(window=0, d_down=12))
    torch.manual_seed(1)
    for attn_dar in (m for n, m in model.named_modules() if n.endswith(".allhere")):
        torch.nn.init.normal_(attn_dar.up.weight, std=0.2)  # not just the transpose of W_down
    oracle = build(name)
    fold_bottleneck(model, oracle)
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        assert rel_err(model(ids).logits, oracle(ids).logits) < 1e-5


GREEDY = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=2)


@pytest.mark.parametrize("name", ["llama", "qwen3", "olmo2", "gpt_neox"])  # k norms; partial rotary, fused qkv
def test_cached_greedy_generation_equals_uncached(name):
    model = convert(build(name), DARConfig(window=3, d_down=12))
    prompt = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        uncached = model.generate(prompt, use_cache=False, **GREEDY)
        out = model.generate(prompt, return_dict_in_generate=True, **GREEDY)  # the cache by default
        given = model.generate(prompt, **cache_kwargs(new_cache(model)), **GREEDY)
    assert torch.equal(out.sequences, uncached) and torch.equal(given, uncached)
    cache = out.past_key_values
    assert all(isinstance(layer, DARCacheLayer) for layer in cache.layers)  # generate's cache, adopted
    assert cache.get_seq_length() == 16 and cache.layers[0].keys.shape[2] == 3  # 7 + 10 - 1 tokens


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("window", [0, 4, 30])
def test_chunked_prefill_and_decode_equal_full_forward(name, window):
    model = convert(build(name), DARConfig(window=window, d_down=12))
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        first = model(ids[:, :7], use_cache=True)  # a cache transformers built, adopted on this call
        parts, cache = [first.logits], first.past_key_values
        parts.append(model(ids[:, 7:12], **cache_kwargs(cache)).logits)
        parts += [model(ids[:, t:t + 1], **cache_kwargs(cache)).logits for t in range(12, 20)]
        own = new_cache(model)  # built up front
        again = torch.cat([model(ids[:, :9], **cache_kwargs(own)).logits,
                           model(ids[:, 9:], **cache_kwargs(own)).logits], 1)
    assert rel_err(torch.cat(parts, 1), full) < 1e-5 and rel_err(again, full) < 1e-5
    assert cache.get_seq_length() == own.get_seq_length() == 20


def test_cache_holds_window_full_kv_and_latents_only():
    """Exactly w tokens' full K/V + every token's latent (and int32 position) per layer, counted as used
    bytes (and the buffers' storage), against the every-key DynamicCache the original model fills."""
    w, d_down, b, t = 4, 8, 2, 64
    model = convert(build("llama"), DARConfig(window=w, d_down=d_down))
    ids = torch.randint(3, 97, (b, t))
    with torch.no_grad():
        dynamic = build("llama")(ids, use_cache=True).past_key_values
        cache = new_cache(model)
        model(ids[:, :40], **cache_kwargs(cache))
        for i in range(40, t):
            model(ids[:, i:i + 1], **cache_kwargs(cache))
    layers, kv_dim, f32 = 2, 2 * 16, 4  # 2 kv heads x head_dim 16
    assert cache_nbytes(dynamic) == layers * 2 * b * t * kv_dim * f32
    used = layers * (2 * b * w * kv_dim * f32 + b * t * (d_down * f32 + 4))
    assert cache_nbytes(cache, used=True) == used
    assert used / cache_nbytes(dynamic) < 0.25  # per further token: 36 bytes instead of 256
    # Storage: the window's buffer (w + 16 tokens of slack) and latent / position buffers of 64 tokens (= t)
    assert cache_nbytes(cache) == layers * (2 * b * (w + 16) * kv_dim * f32 + b * 64 * (d_down * f32 + 4))
    layer = cache.layers[0]
    assert layer.keys.shape == (b, 2, w, 16) and layer.latent.shape == (b, t, d_down)


def test_left_padded_batch_with_the_cache_equals_each_prompt_alone():
    model = convert(build("qwen3"), DARConfig(window=3, d_down=12))
    a, b = torch.randint(3, 97, (1, 10)), torch.randint(3, 97, (1, 6))
    ids = torch.full((2, 10), 2)
    ids[0], ids[1, 4:] = a[0], b[0]  # left padding: rotary positions of row 1 start after it
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        alone = [model.generate(p, **GREEDY)[0, p.shape[1]:] for p in (a, b)]
        batched = model.generate(ids, attention_mask=mask, **GREEDY)[:, 10:]
        uncached = model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY)[:, 10:]
    assert torch.equal(batched[0], alone[0]) and torch.equal(batched[1], alone[1])
    assert torch.equal(batched, uncached)


def test_beam_search_reorders_the_cache():
    model = convert(build("llama"), DARConfig(window=3, d_down=12))
    prompt = torch.randint(3, 97, (2, 6))
    kw = dict(GREEDY, num_beams=3)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **kw), model.generate(prompt, use_cache=False, **kw))


def test_save_load_generate_and_padding(tmp_path):
    model = convert(build("qwen3"), DARConfig(window=3, d_down=16))
    assert model.config.use_cache and model.generation_config.use_cache  # not switched off any more
    save_pretrained(model, tmp_path / "m")
    again = load_pretrained(tmp_path / "m").eval()
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
        assert again.config.allhere_mechanism == model.config.allhere_mechanism
        kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=2)
        assert torch.equal(again.generate(ids[:, :6], **kw), model.generate(ids[:, :6], use_cache=False, **kw))
        a, b = ids[:1, :12], ids[1:, :7]
        padded = torch.full((2, 12), 2)
        padded[0], padded[1, 5:] = a[0], b[0]  # left padding
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :5] = 0
        batched = model(padded, attention_mask=mask).logits
        assert rel_err(batched[0], model(a).logits[0]) < 1e-5
        assert rel_err(batched[1, 5:], model(b).logits[0]) < 1e-5


def test_a_cache_holding_every_key_is_refused():
    model = convert(build("llama"), DARConfig(window=3, d_down=16))
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        full = build("llama")(ids[:, :-1], use_cache=True).past_key_values  # a DynamicCache with every key
        with pytest.raises(RuntimeError, match="own compressed cache.*DynamicCache holding every key"):
            model(ids[:, -1:], **cache_kwargs(full))
        empty = transformers.DynamicCache()  # an empty one is fine: it becomes the compressed cache
        model(ids, **cache_kwargs(empty))
        assert isinstance(empty.layers[0], DARCacheLayer)
    with pytest.raises(ValueError, match="no allhere mechanisms"):
        new_cache(build("llama"))


def test_bad_input():
    with pytest.raises(ConfigError, match="DARConfig.d_down = 100 is invalid: expected <= d_model = 64"):
        convert(build("llama"), DARConfig(window=4, d_down=100))
    with pytest.raises(ConfigError, match="larger than the model's context"):
        convert(build("llama"), DARConfig(window=1000, d_down=8))
    with pytest.raises(ValueError, match="already converted"):
        convert(convert(build("llama"), DARConfig(window=4, d_down=8)), __import__("allhere").AHAConfig(window=4))
