"""The sparse pattern mechanisms (sinks, dilated, longformer, bigbird): configs, the forward against the
dense reference of their predicate, cached decoding equal to the full forward in the Decoder, bounded
caches, segments, checkpoints and the Hugging Face conversion."""

import pytest
import torch

from allhere import ConfigError, Decoder, ModelConfig, use_backend
from allhere.masks import dense_mask, starts_from
from allhere.mechanisms import (
    AttentionCall,
    AttentionDims,
    BigBirdConfig,
    DilatedConfig,
    LongformerConfig,
    SinksConfig,
    SlidingConfig,
    bigbird_schedule,
    dilation_schedule,
    mechanism_layers,
)
from allhere.ops.full import masked_attention, pattern_attention_reference
from allhere.registry import build, from_dict, to_dict
from allhere.runtime.model_checkpoint import load_model, save_checkpoint

from helpers import rel_err

DIMS = AttentionDims(32, 4, 2, 8)

CONFIGS = {
    "sinks": SinksConfig(window=4, n_sinks=2),
    "dilated": DilatedConfig(window=3, dilation=(1, 2, 3, 1)),
    "longformer": LongformerConfig(window=3, dilation=2, global_first=2, global_positions=(9,)),
    "bigbird": BigBirdConfig(block=2, window_blocks=2, global_blocks=1, random_blocks=1, seed=1),
}
ENCODERS = {
    "sinks": SinksConfig(window=4, n_sinks=2, causal=False),
    "dilated": DilatedConfig(window=3, dilation=2, causal=False),
    "longformer": LongformerConfig(window=3, global_positions=(4, 9), causal=False),
    "bigbird": BigBirdConfig(block=4, window_blocks=2, global_blocks=1, random_blocks=1, causal=False),
}


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g),
            torch.randn(2, 2, n, 8, generator=g))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_reference_of_its_predicate(name):
    for cfg in (CONFIGS[name], ENCODERS[name]):
        mech = build(cfg, DIMS)
        q, k, v = qkv(37)
        for dense_below in (0, 1 << 16):  # the block-sparse (or fast) path, the dense one
            mech.dense_below = dense_below
            out, routing = mech(q, k, v, AttentionCall(x=None))
            assert routing is None
            assert rel_err(out, pattern_attention_reference(q, k, v, cfg.mask_fn(37))) < 1e-5
        with torch.no_grad():  # queries: the last q_len of the keys
            out, _ = mech(q[:, :, -9:], k, v, AttentionCall(x=None))
        assert rel_err(out, pattern_attention_reference(q[:, :, -9:], k, v, cfg.mask_fn(37))) < 1e-5
        # the predicate is the pattern the config describes
        assert dense_mask(cfg.mask_fn(37), 37, 37, heads=4).any(-1).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_given_positions_place_the_pattern_over_the_keys_at_hand(name):
    """``AttentionCall.positions`` (a shard of a longer sequence): the predicate is evaluated at those
    positions, contiguous (the block-sparse path with a key offset) or scattered (the dense path), with
    and without segments."""
    cfg = CONFIGS[name]
    mech = build(cfg, DIMS)
    q, k, v = qkv(19)
    pred = cfg.mask_fn(64)
    for pos in (torch.arange(7, 26), torch.cat([torch.arange(3, 12), torch.arange(40, 50)])):
        qp, kp = pos.view(1, 1, -1, 1), pos.view(1, 1, 1, -1)
        mask = pred(torch.arange(2).view(-1, 1, 1, 1), torch.arange(4).view(1, -1, 1, 1), qp, kp)
        starts = torch.full((2, 19), int(pos[0]))
        starts[1, 10:] = int(pos[10])
        seg = mask & (kp >= starts[:, None, :, None])
        for dense_below in (0, 1 << 16):
            mech.dense_below = dense_below
            out, _ = mech(q, k, v, AttentionCall(x=None, positions=pos))
            assert rel_err(out, masked_attention(q, k, v, mask.expand(2, 4, 19, 19))) < 1e-5
            out, _ = mech(q, k, v, AttentionCall(x=None, positions=pos, segment_starts=starts))
            assert rel_err(out, masked_attention(q, k, v, seg.expand(2, 4, 19, 19))) < 1e-5
    if name != "dilated":  # the others place something at absolute positions (sinks, globals, blocks)
        base, _ = mech(q, k, v, AttentionCall(x=None))
        assert rel_err(mech(q, k, v, AttentionCall(x=None, positions=torch.arange(7, 26)))[0], base) > 1e-3


def test_config_fields_validation_and_json():
    for cfg in [*CONFIGS.values(), *ENCODERS.values(), BigBirdConfig(layer=3)]:
        assert from_dict(to_dict(cfg)) == cfg
    assert from_dict({"kind": "dilated", "window": 3, "dilation": [1, 2]}).dilation == (1, 2)
    assert LongformerConfig(global_positions=[9, 3, 9]).global_positions == (3, 9)
    for bad, field in [(lambda: SinksConfig(window=0), "window"), (lambda: SinksConfig(n_sinks=-1), "n_sinks"),
                       (lambda: DilatedConfig(dilation=0), "dilation"),
                       (lambda: DilatedConfig(dilation=(1, 0)), "dilation"),
                       (lambda: LongformerConfig(global_positions=(-1,)), "global_positions"),
                       (lambda: LongformerConfig(causal=1), "causal"), (lambda: BigBirdConfig(block=0), "block"),
                       (lambda: BigBirdConfig(random_blocks=-2), "random_blocks")]:
        with pytest.raises(ConfigError, match=field):
            bad()
    with pytest.raises(ConfigError, match="one dilation per query head"):
        build(DilatedConfig(dilation=(1, 2)), DIMS)
    assert [c.dilation for c in dilation_schedule(8, (1, 2, 4))] == [1, 2, 4]
    assert [c.layer for c in bigbird_schedule(3, block=4)] == [0, 1, 2]


def tiny(mech, n_layers=2):
    torch.manual_seed(0)
    if isinstance(mech, tuple):
        return Decoder(ModelConfig(vocab_size=40, d_model=32, n_layers=len(mech), n_heads=4, n_kv_heads=2,
                                   layer_mechanisms=mech)).eval()
    return Decoder(ModelConfig(vocab_size=40, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                               mechanism=mech)).eval()


@pytest.mark.parametrize("name", [*CONFIGS, "schedules"])
def test_decoder_cache_chunks_segments_and_checkpoint(name, tmp_path):
    if name == "schedules":
        model = tiny(dilation_schedule(3, (1, 4)) + bigbird_schedule(2, block=2, window_blocks=1, random_blocks=2))
    else:
        model = tiny(CONFIGS[name])
    ids = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        for m in mechanism_layers(model):  # the block-sparse / fast paths agree with the dense one
            m.dense_below = 0
        assert rel_err(model(ids).logits, logits) < 1e-5
        for m in mechanism_layers(model):
            m.dense_below = 1 << 16
        cache = model.new_cache()
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(23)], 1)
        assert rel_err(steps, logits) < 1e-5  # token by token == the full forward
        cache = model.new_cache()
        chunks = torch.cat([model(ids[:, a:b], cache=cache).logits for a, b in ((0, 10), (10, 13), (13, 23))], 1)
        assert rel_err(chunks, logits) < 1e-5
        # packed documents: the first document alone, and left padding that nothing reads
        positions = torch.cat([torch.arange(11), torch.arange(12)])[None].expand(2, -1)
        packed = model(ids, segment_starts=starts_from(position_ids=positions)).logits
        assert rel_err(packed[:, :11], model(ids[:, :11]).logits) < 1e-5
        assert rel_err(packed[:, 11:], logits[:, 11:]) > 1e-3  # the second document no longer reads the first
    save_checkpoint(tmp_path / "m.safetensors", model, None, {"step": 0})
    again, _ = load_model(tmp_path / "m.safetensors")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)


@pytest.mark.parametrize("cfg,kept", [(SinksConfig(window=16, n_sinks=4), 4 + 16),
                                      (DilatedConfig(window=8, dilation=(1, 3, 2, 3)), 7 * 3 + 1),
                                      (LongformerConfig(window=8, dilation=2, global_first=3, global_positions=(40,)),
                                       15 + 4)])
def test_cache_memory_is_bounded(cfg, kept):
    """Decode 512 tokens one by one: the cache's bytes stop growing (sinks + window; the dilated span; the
    window's span plus the global tokens once the last global query has passed), and every step equals the
    dense reference over the whole sequence."""
    mech = build(cfg, DIMS)
    cache = mech.new_cache()
    q, k, v = qkv(512)
    sizes = {}
    pred = cfg.mask_fn(512)
    for t in range(512):
        out, _ = mech(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], AttentionCall(x=None), cache=cache)
        if t in (63, 200, 511):
            want = pattern_attention_reference(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], pred)
            assert rel_err(out, want) < 1e-5
        sizes[t] = (cache.nbytes(), len(cache))
    assert sizes[63] == sizes[300] == sizes[511]
    assert sizes[511][1] in (kept, kept + 1)  # rolling caches may hold one key more than the next query reads


def test_bigbird_cache_keeps_every_key_and_encoders_refuse_a_cache():
    mech = build(CONFIGS["bigbird"], DIMS)
    cache = mech.new_cache()
    q, k, v = qkv(20)
    mech(q, k, v, AttentionCall(x=None), cache=cache)
    assert len(cache) == 20
    for cfg in ENCODERS.values():
        m = build(cfg, DIMS)
        with pytest.raises(ValueError, match="causal=False"):
            m(q, k, v, AttentionCall(x=None), cache=m.new_cache())


def tiny_hf(kind, **extra):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    cfg = (transformers.MistralConfig if kind == "mistral" else transformers.LlamaConfig)(**common, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("mech", [SlidingConfig(window=5), SinksConfig(window=5, n_sinks=0)])
def test_hf_mistral_sliding_window_matches_transformers(mech):
    from allhere.hf import convert

    model = tiny_hf("mistral", sliding_window=5)
    ids = torch.randint(1, 40, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(ids).logits  # transformers' own Mistral sliding-window attention
        convert(model, mech, layers="all")  # every layer is sliding: the mechanism replaces that window
        assert rel_err(model(ids).logits, theirs) < 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_conversion_equals_the_reference_mask(name):
    from allhere.hf import convert

    cfg = CONFIGS[name]
    model = tiny_hf("llama")
    ids = torch.randint(1, 40, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = dense_mask(cfg.mask_fn(14), 14, 14, heads=4)
    assert (mask == mask[:, :1]).all() or name == "dilated" or name == "bigbird"
    with torch.no_grad():
        if (mask == mask[:, :1]).all():  # one pattern for every head: transformers' own SDPA under the 4-D mask
            oracle = model(ids, attention_mask=mask[:, :1].expand(2, 1, 14, 14)).logits
        else:  # per-head patterns: transformers' eager attention under a per-head 4-D float mask
            model.set_attn_implementation("eager")
            add = torch.zeros(2, 4, 14, 14).masked_fill(~mask.expand(2, 4, 14, 14), float("-inf"))
            oracle = model(ids, attention_mask=add).logits
            model.set_attn_implementation("sdpa")
        convert(model, cfg)
        assert rel_err(model(ids).logits, oracle) < 1e-5
        kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.slow
def test_flex_attention_backend_equals_reference():
    """FlexAttention (compiled; about 20 s on a CPU) under a BigBird pattern with per-head random blocks, GQA."""
    cfg = BigBirdConfig(block=16, window_blocks=2, global_blocks=1, random_blocks=1, seed=1)
    mech = build(cfg, DIMS)
    mech.dense_below = 0
    q, k, v = qkv(128)
    with torch.no_grad(), use_backend("flex"):
        out, _ = mech(q, k, v, AttentionCall(x=None))
    assert rel_err(out, pattern_attention_reference(q, k, v, cfg.mask_fn(128))) < 1e-5


def test_flex_is_compiled_for_a_bounded_number_of_shapes(monkeypatch):
    """Past ``flex_shapes`` (pattern, shape) pairs a new shape takes the block-sparse op: FlexAttention
    compiles per shape, and past dynamo's limit it would run unfused over the whole score matrix."""
    import allhere.ops.flex as flex

    def no_flex(*args, **kwargs):
        raise AssertionError("FlexAttention was called")

    monkeypatch.setattr(flex, "flex_pattern_attention", no_flex)
    cfg = CONFIGS["longformer"]
    mech = build(cfg, DIMS)
    mech.dense_below, mech.flex_min_queries, mech.flex_shapes = 0, 1, 0
    q, k, v = qkv(37)
    with use_backend("flex"):
        out, _ = mech(q, k, v, AttentionCall(x=None))
    assert rel_err(out, pattern_attention_reference(q, k, v, cfg.mask_fn(37))) < 1e-5


@pytest.mark.parametrize("cfg", [SlidingConfig(window=256), SinksConfig(window=252, n_sinks=4),
                                 LongformerConfig(window=240, global_first=16)])
def test_cache_bytes_constant_from_4k_to_64k_generated_tokens(cfg):
    """The bounded caches fed 64k tokens (1k-token chunks, then single tokens): the same bytes at 4k, 16k
    and 64k, at most window + sinks / globals (+1) keys."""
    cache = build(cfg, DIMS).new_cache()
    chunk = torch.randn(1, DIMS.kv_heads, 1024, DIMS.head_dim)
    sizes = {}
    for i in range(64):
        cache.update(chunk, chunk)
        sizes[(i + 1) * 1024] = cache.nbytes()
    for _ in range(8):
        cache.update(chunk[:, :, :1], chunk[:, :, :1])
    assert sizes[4096] == sizes[16384] == sizes[65536] == cache.nbytes()
    assert len(cache) <= 257


@pytest.mark.parametrize("backend", ["blocksparse", "flex"])
def test_one_block_structure_per_forward_for_all_layers(backend, monkeypatch):
    """Three Longformer layers build one tile plan (block-sparse op) or one BlockMask (FlexAttention) for all
    of them: once in all without segment boundaries, once per forward with them. Each layer used to build
    its own, and with segments at every call: L builds per forward (at 32k tokens on a GPU, tens of ms each)."""
    import allhere.mechanisms.masked_base as base
    import allhere.ops.flex as flex
    from allhere.mechanisms.block_cache import BlockCache

    monkeypatch.setattr(base.PatternAttention, "_blocks", BlockCache())
    monkeypatch.setattr(base.PatternAttention, "_flex_seen", set())
    builds = []
    if backend == "flex":  # the kernel is not what is counted: a stand-in spares the CPU its compilation
        real = flex.flex_block_mask
        monkeypatch.setattr(flex, "flex_block_mask", lambda *a, **kw: builds.append(1) or real(*a, **kw))
        monkeypatch.setattr(flex, "flex_pattern_attention", lambda q, k, v, mask, scale=None: torch.zeros_like(q))
    else:
        real = base.plan_blocks
        monkeypatch.setattr(base, "plan_blocks", lambda *a, **kw: builds.append(1) or real(*a, **kw))
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                      mechanism=LongformerConfig(window=32, global_first=4))
    model = Decoder(cfg).eval()
    n = 384  # past dense_below (q x k > 2^16) and flex_min_queries
    ids = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(n).remainder(100).expand(2, n)  # packed documents of 100 tokens
    with torch.no_grad(), use_backend("flex" if backend == "flex" else "torch"):
        model(ids)
        model(ids)
        assert len(builds) == 1
        model(ids, segment_starts=starts_from(position_ids=positions))
        model(ids, segment_starts=starts_from(position_ids=positions))  # a new batch: new starts
        assert len(builds) == 3
