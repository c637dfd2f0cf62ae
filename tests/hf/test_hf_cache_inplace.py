"""Converted Hugging Face models decode with caches written in place (``allhere.hf.cache.InPlaceLayer``):
generations equal uncached ones, the buffers are reallocated O(log tokens) times, beam search and cropping
keep working, and a hybrid's unconverted layers keep transformers' own layers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402

from allhere import AHAConfig, SinksConfig, SlidingConfig  # noqa: E402
from allhere.hf import convert, new_cache  # noqa: E402
from allhere.hf.cache import InPlaceLayer, cache_kwargs  # noqa: E402

from helpers import mixed_routers, rel_err  # noqa: E402
from hf_fixtures import write_model  # noqa: E402
from test_hf import build  # noqa: E402

GREEDY = dict(do_sample=False, pad_token_id=0)


def aha_model(name="llama"):
    """AHA with a router that sends some (token, head) pairs global and keeps the rest local."""
    return mixed_routers(convert(build(name), AHAConfig(window=4)))


@pytest.mark.parametrize("cfg", [AHAConfig(window=4), SlidingConfig(window=5), SinksConfig(window=4, n_sinks=2)],
                         ids=["aha", "sliding", "sinks"])
def test_cached_generation_equals_uncached_and_the_layers_are_in_place(cfg):
    model = aha_model() if isinstance(cfg, AHAConfig) else convert(build("qwen2"), cfg)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, return_dict_in_generate=True, **GREEDY)
        plain = model.generate(ids, max_new_tokens=40, use_cache=False, **GREEDY)
    assert torch.equal(out.sequences, plain)
    layers = out.past_key_values.layers
    assert all(type(layer) is InPlaceLayer for layer in layers)
    # 9 + 39 tokens cached: buffers of 64 tokens, allocated once (doubling: O(log tokens) in general)
    assert all(layer._kv.reallocations == 1 and layer.get_seq_length() == 48 for layer in layers)


def test_a_decode_step_writes_into_the_same_buffer_and_matches_a_full_forward():
    model = aha_model("olmo2")
    ids = torch.randint(3, 97, (1, 30))
    with torch.no_grad():
        full = model(ids).logits
        cache = new_cache(model)
        steps = [model(ids[:, :20], **cache_kwargs(cache)).logits]
        ptr = cache.layers[0].keys.data_ptr()
        for t in range(20, 30):
            steps.append(model(ids[:, t:t + 1], **cache_kwargs(cache)).logits)
            assert cache.layers[0].keys.data_ptr() == ptr  # no copy of the cache per token
    assert rel_err(torch.cat(steps, dim=1), full) < 1e-5


def test_beam_search_and_crop():
    model = aha_model("qwen3")
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        beams = model.generate(ids, max_new_tokens=10, num_beams=3, **GREEDY)
        plain = model.generate(ids, max_new_tokens=10, num_beams=3, use_cache=False, **GREEDY)
        assert torch.equal(beams, plain)  # reorder_cache / batch_repeat_interleave on the buffers
        cache = new_cache(model)
        model(ids, **cache_kwargs(cache))
        cache.crop(-3)  # drop the last 3 of 8 tokens: assisted generation's rollback
        assert cache.get_seq_length() == 5
        again = model(ids[:, 5:], **cache_kwargs(cache)).logits
    assert rel_err(again, model(ids).logits[:, 5:]) < 1e-5


def test_a_hybrid_keeps_transformers_layers_where_it_is_not_converted(tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(write_model("Gemma-3-1B-it", tmp_path)),
                                                              dtype=torch.float32)
    convert(model, AHAConfig(window=4))
    cache = new_cache(model)
    kinds = model.config.layer_types
    assert len(cache.layers) == len(kinds) == model.config.num_hidden_layers
    for kind, layer in zip(kinds, cache.layers):
        assert type(layer) is (InPlaceLayer if kind == "full_attention" else DynamicSlidingWindowLayer)
    ids = torch.randint(7, 200, (1, 12))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, return_dict_in_generate=True, **GREEDY)
    assert {type(layer) for layer in out.past_key_values.layers} == {InPlaceLayer, DynamicSlidingWindowLayer}
    assert not any(type(layer) is DynamicLayer for layer in out.past_key_values.layers)


class NumberTokenizer:
    """Token ids in, their numbers out: enough for ``allhere.generation.generate``."""

    eos_token_id, pad_token_id, chat_template = None, 0, None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_allhere_generate_sizes_the_in_place_cache_once(monkeypatch):
    """``allhere generate`` hands transformers' ``generate`` a cache whose in-place layers hold prompt + reply
    from the start: one allocation. Filled by the prompt alone (100 tokens: 128 of room), a layer doubled
    at the 129th token; a 128k-token prompt on a GPU would hold room for 256k (twice the bytes)."""
    import allhere.hf.cache as hf_cache
    from allhere.generation import generate

    made, real = [], hf_cache.new_cache
    monkeypatch.setattr(hf_cache, "new_cache",
                        lambda model, reserve=None: made.append(real(model, reserve)) or made[-1])
    model = aha_model()
    reply = generate(model, NumberTokenizer(), list(range(3, 97)) + [3] * 6, max_new_tokens=30)
    assert len(reply.ids) == 30 and len(made) == 1
    for layer in made[0].layers:
        assert layer.get_seq_length() == 129 and layer._kv.reallocations == 1 and layer._kv.capacity == 192
