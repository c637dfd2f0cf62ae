"""Hugging Face conversion, offline: tiny random-weight configs built here, no downloads."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhere import AHAConfig, ConfigError, DARConfig, set_forced_gate, use_backend  # noqa: E402  (the one set_forced_gate, for HF models too)
from allhere.hf import collect_routing, convert, load_pretrained, save_pretrained  # noqa: E402

from helpers import rel_err  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, eos_token_id=1, bos_token_id=0, pad_token_id=2)


def family_config(name):
    t = transformers
    if name == "gpt_neox":  # partial rotary, fused qkv, no grouped-query heads
        return t.GPTNeoXConfig(rotary_pct=0.25, **COMMON)
    cls = {"llama": t.LlamaConfig, "mistral": t.MistralConfig, "qwen2": t.Qwen2Config, "qwen3": t.Qwen3Config,
           "olmo2": t.Olmo2Config}[name]
    extra = {"sliding_window": None} if name == "mistral" else {}
    return cls(num_key_value_heads=2, **COMMON, **extra)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "olmo2", "gpt_neox"]


def build(name, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(family_config(name), attn_implementation="sdpa").eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_forced_full_equals_original_and_global_init_too(name):
    model = build(name)
    ids = torch.randint(3, 97, (2, 24))
    with torch.no_grad():
        ref = model(ids).logits
        convert(model, AHAConfig(window=4))  # router_init="global": every gate starts open
        assert rel_err(model(ids).logits, ref) < 1e-5
        assert collect_routing(model).mu_f().item() == 1.0
        set_forced_gate(model, True)
        assert rel_err(model(ids).logits, ref) < 1e-5
        set_forced_gate(model, False)
        assert rel_err(model(ids).logits, ref) > 1e-3  # the window changes something at 24 tokens


def test_mistral_own_sliding_window_is_the_oracle_for_forced_local():
    w = 5
    oracle = build("mistral")
    oracle.config.sliding_window = w  # transformers' own sliding-window attention
    ours = build("mistral")
    ours.load_state_dict(oracle.state_dict())
    convert(ours, AHAConfig(window=w))
    set_forced_gate(ours, False)
    ids = torch.randint(3, 97, (2, 30))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, oracle(ids).logits) < 1e-5


@pytest.mark.parametrize("name", ["llama", "olmo2", "gpt_neox"])
def test_save_then_load_gives_identical_logits(name, tmp_path):
    model = convert(build(name), AHAConfig(window=4, router_init="neutral"))
    save_pretrained(model, tmp_path / "m")
    again = load_pretrained(tmp_path / "m").eval()
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert again.config.allhere_mechanism == model.config.allhere_mechanism


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt_neox"])
def test_cached_greedy_generation_equals_uncached(name):
    model = convert(build(name), AHAConfig(window=3, router_init="neutral"))
    prompt = torch.randint(3, 97, (2, 7))
    kw = dict(max_new_tokens=10, do_sample=False, min_new_tokens=10, pad_token_id=2)
    with torch.no_grad():
        uncached = model.generate(prompt, use_cache=False, **kw)
        cached = model.generate(prompt, use_cache=True, **kw)
    assert torch.equal(cached, uncached)
    routing = collect_routing(model)  # with the cache, the last step routed one new token per head
    assert routing.per_layer[0].gates.shape == (2, 4, 1)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_padded_batch_equals_one_by_one(name):
    model = convert(build(name), AHAConfig(window=3, router_init="neutral"))
    a, b = torch.randint(3, 97, (1, 12)), torch.randint(3, 97, (1, 7))
    ids = torch.full((2, 12), 2)
    ids[0], ids[1, 5:] = a[0], b[0]  # left padding
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        one_a, one_b = model(a).logits, model(b).logits
        batched = model(ids, attention_mask=mask).logits
    assert rel_err(batched[0], one_a[0]) < 1e-5
    assert rel_err(batched[1, 5:], one_b[0]) < 1e-5


@pytest.mark.parametrize("path", ["pytorch", "kernels"])
def test_left_padded_batch_and_generation_equal_one_by_one(monkeypatch, path):
    """A left-padded batch's logits and its cached greedy generation equal every prompt alone, on the
    PyTorch path (one segment at a time) and on the Triton kernels (forced here, Triton's interpreter on
    the CPU: one launch per layer, no per-segment path)."""
    model = convert(build("qwen2"), AHAConfig(window=3, router_init="neutral"))
    a, b = torch.randint(3, 97, (1, 10)), torch.randint(3, 97, (1, 6))
    ids = torch.full((2, 10), 2)
    ids[0], ids[1, 4:] = a[0], b[0]
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        alone = [model.generate(p, **kw)[0, p.shape[1]:] for p in (a, b)]
        logits = [model(p).logits[0] for p in (a, b)]
        if path == "kernels":
            pytest.importorskip("triton")
            from allhere.ops.aha import fast

            monkeypatch.setattr(fast, "_per_segment", None)  # the kernels must take the segments themselves
        with use_backend("triton" if path == "kernels" else "torch"):
            batched_logits = model(ids, attention_mask=mask).logits
            batched = model.generate(ids, attention_mask=mask, **kw)[:, 10:]
    assert rel_err(batched_logits[0], logits[0]) < 1e-5 and rel_err(batched_logits[1, 4:], logits[1]) < 1e-5
    assert torch.equal(batched[0], alone[0]) and torch.equal(batched[1], alone[1])


def test_any_decoder_on_the_attention_interface_converts_and_others_are_refused():
    """GPT-2 is in no table of allhere's, but its attention goes through transformers' attention interface:
    it converts (learned absolute positions: K/V do not depend on the position, so DAR too). Mamba has no
    attention module on that interface: one line saying so."""
    config = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    torch.manual_seed(0)
    gpt2 = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    ids = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        ref = gpt2(ids).logits
        for mech in (AHAConfig(window=4), DARConfig(window=4, d_down=32)):
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
            model.load_state_dict(gpt2.state_dict())
            convert(model, mech)
            set_forced_gate(model, True) if isinstance(mech, AHAConfig) else None
            assert rel_err(model(ids).logits, ref) < 1e-5, mech
            kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(model.generate(ids[:, :6], use_cache=True, **kw),
                               model.generate(ids[:, :6], use_cache=False, **kw))
    model = convert(transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)), AHAConfig(window=4))
    model.train()  # GPT-2's attention dropout (attn_pdrop 0.1) is off on the converted layers: training runs
    model(ids).logits.float().pow(2).mean().backward()
    assert model.transformer.h[0].attn.allhere.router.weight.grad is not None
    deepseek = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(
        vocab_size=50, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1))
    with pytest.raises(ConfigError, match="v_head_dim = 8 differs"):
        convert(deepseek, AHAConfig(window=4))
    mamba = transformers.AutoModelForCausalLM.from_config(
        transformers.MambaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, state_size=4))
    with pytest.raises(ConfigError, match="no attention module calls transformers' attention interface"):
        convert(mamba, AHAConfig(window=4))
    with pytest.raises(ConfigError, match="larger than the model's context"):
        convert(build("llama"), AHAConfig(window=1000))
    with pytest.raises(ConfigError, match="qproj"):
        convert(build("llama"), AHAConfig(window=4, router="qproj"))


def test_contract_with_transformers_interfaces():
    """Fails loudly if transformers changes the interfaces the integration relies on."""
    import inspect

    from transformers import AttentionInterface
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert hasattr(AttentionInterface, "register") and hasattr(AttentionMaskInterface, "register")
    params = inspect.signature(sdpa_mask).parameters
    for name in ("batch_size", "q_length", "kv_length", "attention_mask", "allow_is_causal_skip"):
        assert name in params, name
    assert hasattr(DynamicCache, "update")
    model = convert(build("llama"), AHAConfig(window=4))
    assert model.config._attn_implementation == "allhere"
    src = inspect.getsource(type(model.model.layers[0].self_attn).forward)
    assert "attention_interface(" in src and ("cache.update" in src or "past_key_values.update" in src)
    from allhere.hf.attention import _CACHE_ARGS

    forward = inspect.signature(type(model.model.layers[0].self_attn).forward).parameters
    assert set(forward) & set(_CACHE_ARGS)  # the name the module takes its cache by is one allhere reads
