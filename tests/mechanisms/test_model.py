import pytest
import torch

from allhere import (
    AHAConfig,
    DARConfig,
    Decoder,
    FullConfig,
    ModelConfig,
    SlidingConfig,
    TrainConfig,
    set_forced_gate,
    swap_mechanism,
    use_backend,
)
from allhere.masks import starts_from
from allhere.train import make_optimizer

from helpers import rel_err

MECHS = {
    "full": FullConfig(),
    "sliding": SlidingConfig(window=5),
    "aha-linear": AHAConfig(window=4, router_init="neutral"),
    "aha-qproj": AHAConfig(window=3, router="qproj", router_init="neutral"),
    "aha-nobias": AHAConfig(window=4, router_bias=False, router_init="neutral"),
    "mixed": [FullConfig(), SlidingConfig(window=3), AHAConfig(window=2, router_init="neutral")],
    "dar": DARConfig(window=4, d_down=8),
}
# Every built-in kind's example is held to cached decoding (MHA / GQA / MQA), chunked prefill and packed
# documents by tests/mechanisms/test_contract.py; here the variants it does not cover: the other routers, mixed layers.
VARIANTS = ["aha-qproj", "aha-nobias", "mixed"]


def tiny(mech, kv_heads=2, layers=3):
    kw = {"layer_mechanisms": tuple(mech)} if isinstance(mech, list) else {"mechanism": mech}
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=layers, n_heads=4, n_kv_heads=kv_heads, **kw)
    return Decoder(cfg).eval()


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("name", VARIANTS)
def test_cached_token_by_token_equals_full_forward(name, kv_heads):
    model = tiny(MECHS[name], kv_heads)
    ids = torch.randint(0, 61, (2, 19))
    full = model(ids)
    cache = model.new_cache()
    steps = [model(ids[:, t:t + 1], cache=cache) for t in range(19)]
    assert rel_err(torch.cat([s.logits for s in steps], 1), full.logits) < 1e-5
    if full.routing is not None:  # the same gates, token by token
        for li in range(len(full.routing.layers)):
            step_gates = torch.cat([s.routing.per_layer[li].gates for s in steps], dim=2)
            assert torch.equal(step_gates, full.routing.per_layer[li].gates)


@pytest.mark.parametrize("name", VARIANTS)
def test_chunked_prefill_then_decode_equals_full_forward(name):
    model = tiny(MECHS[name])
    ids = torch.randint(0, 61, (2, 23))
    cache = model.new_cache()
    parts = [model(ids[:, :9], cache=cache).logits, model(ids[:, 9:16], cache=cache).logits]
    parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(16, 23)]
    assert rel_err(torch.cat(parts, 1), model(ids).logits) < 1e-5


def test_sliding_cache_stays_at_window():
    model = tiny(SlidingConfig(window=5))
    cache = model.new_cache()
    model(torch.randint(0, 61, (1, 12)), cache=cache)
    assert [len(c) for c in cache.layers] == [5, 5, 5]
    for t in range(20):
        model(torch.randint(0, 61, (1, 1)), cache=cache)
        assert all(len(c) == 5 for c in cache.layers)
    aha = tiny(AHAConfig(window=5))
    cache = aha.new_cache()
    aha(torch.randint(0, 61, (1, 12)), cache=cache)
    assert [len(c) for c in cache.layers] == [12, 12, 12]  # AHA keeps every key


def test_torch_and_reference_backends_agree_in_training_mode():
    model = tiny(AHAConfig(window=3, router_init="neutral")).train()
    ids = torch.randint(0, 61, (2, 21))
    grads = []
    for backend in ("torch", "reference"):
        model.zero_grad()
        with use_backend(backend):
            out = model(ids)
            (out.logits.square().mean() + out.routing.l_reg()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert rel_err(grads[0][n], grads[1][n]) < 1e-4, n
    assert grads[0]["blocks.0.attn.mechanism.router.weight"].abs().sum() > 0


@pytest.mark.parametrize("router", ["linear", "qproj"])
def test_swap_to_aha_with_global_init_reproduces_the_full_model(router):
    base = tiny(FullConfig())
    ids = torch.randint(0, 61, (2, 17))
    aha = swap_mechanism(base, AHAConfig(window=3, router=router)).eval()  # router_init="global"
    out = aha(ids)
    assert out.routing.mu_f().item() == 1.0
    assert rel_err(out.logits, base(ids).logits) < 1e-5
    set_forced_gate(aha, False)
    local = swap_mechanism(base, SlidingConfig(window=3)).eval()
    assert rel_err(aha(ids).logits, local(ids).logits) < 1e-5
    set_forced_gate(aha, None)
    assert aha(ids).routing.mu_f().item() == 1.0


def test_router_inits():
    ids = torch.randint(0, 61, (2, 30))
    assert tiny(AHAConfig(window=3, router_init="local"))(ids).routing.mu_f().item() == 0.0
    mu = tiny(AHAConfig(window=3, router_init="neutral"))(ids).routing.mu_f().item()
    assert 0.2 < mu < 0.8
    # the paper's bias-free router starts at s = 0.5 exactly, so g = 1[s > 0.5] is closed everywhere
    out = tiny(AHAConfig(window=3, router_bias=False))(ids)
    assert out.routing.mu_f().item() == 0.0
    assert torch.allclose(out.routing.l_reg(), torch.tensor(0.5))


def test_generate_uses_the_cache_consistently():
    model = tiny(AHAConfig(window=3, router_init="neutral"))
    prompt = torch.randint(0, 61, (2, 6))
    out = model.generate(prompt, 8)
    assert out.shape == (2, 14) and torch.equal(out[:, :6], prompt)
    ids = out[:, :-1]  # uncached greedy check: each generated token is the argmax of the full forward
    assert torch.equal(model(ids).logits[:, 5:].argmax(-1), out[:, 6:])


def test_per_head_forced_gates_fix_each_head():
    from allhere.analysis.static import set_static_heads, static_budget_k, top_k_heads

    model = tiny(AHAConfig(window=3, router_init="neutral"), kv_heads=4, layers=2)
    usage = torch.tensor([[0.9, 0.0, 0.2, 0.1], [0.0, 0.5, 0.0, 0.0]])
    k = static_budget_k(0.2, 8)
    assert k == 2
    heads = top_k_heads(usage, k)
    assert heads.nonzero().tolist() == [[0, 0], [1, 1]]
    set_static_heads(model, heads)
    out = model(torch.randint(0, 61, (2, 16)))
    for row, r in enumerate(out.routing.per_layer):
        assert torch.equal(r.gates, heads[row].view(1, -1, 1).expand_as(r.gates))
    set_static_heads(model, None)
    routed = model(torch.randint(0, 61, (2, 16))).routing.per_layer[0]
    assert torch.equal(routed.gates, routed.scores > 0.5)  # the router decides again


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_documents_and_padding_equal_each_sequence_alone(name):
    """segment_starts keeps packed documents and padding (either side) apart (every kind: test_contract.py)."""
    model = tiny(MECHS[name])
    docs = [torch.randint(0, 61, (n,)) for n in (7, 5, 9)]
    alone = [model(d[None]).logits[0] for d in docs]
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    out = model(packed, segment_starts=starts_from(position_ids=positions)).logits[0]
    assert rel_err(out, torch.cat(alone)) < 1e-5
    pad = 4  # left padding in row 0, right padding in row 1
    batch = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), docs[2]]),
                         torch.cat([docs[2], torch.zeros(pad, dtype=torch.long)])])
    real = batch != 0
    real[0, :pad], real[1, -pad:], real[0, pad:], real[1, :-pad] = False, False, True, True
    out = model(batch, segment_starts=starts_from(padding_mask=real)).logits
    assert rel_err(out[0, pad:], alone[2]) < 1e-5 and rel_err(out[1, :-pad], alone[2]) < 1e-5


@pytest.mark.parametrize("name", ["sliding", "aha-linear", "dar", "mixed"])
def test_left_padded_cached_decoding_equals_each_prompt_alone(name):
    model = tiny(MECHS[name])
    prompts = [torch.randint(1, 61, (n,)) for n in (9, 4)]
    pad = 5
    batch = torch.stack([prompts[0], torch.cat([torch.zeros(pad, dtype=torch.long), prompts[1]])])
    real = torch.ones_like(batch, dtype=torch.bool)
    real[1, :pad] = False
    starts = starts_from(padding_mask=real)
    cache = model.new_cache()
    logits = [model(batch, cache=cache, segment_starts=starts).logits[:, -1]]
    for t in range(6):  # feed fixed tokens; each step's queries keep their segment start
        nxt = torch.full((2, 1), 3 + t)
        logits.append(model(nxt, cache=cache, segment_starts=starts[:, -1:]).logits[:, -1])
    for i, p in enumerate(prompts):
        ids = torch.cat([p, torch.arange(3, 9)])
        ref = model(ids[None]).logits[0, len(p) - 1:]
        assert rel_err(torch.stack([step[i] for step in logits]), ref) < 1e-5


def test_aha_gate_uses_the_configs_tau():
    """tau = 0.7: scores in (0.5, 0.7] are local; outputs and gradients follow 1[s > 0.7]."""
    model = tiny(AHAConfig(window=3, tau=0.7, router_init="neutral"), layers=1).train()
    mech = model.blocks[0].attn.mechanism
    with torch.no_grad():
        mech.router.bias.fill_(0.8)  # logits near 0.8: scores near 0.69, on both sides of 0.7 and all above 0.5
        mech.router.weight.normal_(0.0, 0.05)
    ids = torch.randint(0, 61, (2, 20))
    out = model(ids)
    r = out.routing.per_layer[0]
    assert torch.equal(r.gates, r.scores > 0.7)
    assert bool(((r.scores > 0.5) & ~r.gates).any()) and bool(r.gates.any())
    out.logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with use_backend("reference"):
        ref = model(ids)
        ref.logits.square().mean().backward()
    assert rel_err(out.logits, ref.logits) < 1e-5
    assert all(rel_err(grads[n], p.grad) < 1e-4 for n, p in model.named_parameters())


@pytest.mark.parametrize("router", ["linear", "qproj"])
def test_router_parameters_get_the_router_lr_and_no_weight_decay(router):
    model = tiny(AHAConfig(window=3, router=router))
    opt = make_optimizer(model, TrainConfig(lr=1e-3, router_lr_mult=10.0, weight_decay=0.1))
    router_group = next(g for g in opt.param_groups if g["lr_mult"] == 10.0)
    mechs = [b.attn.mechanism for b in model.blocks]
    expected = {id(p) for m in mechs for p in m.parameters()}
    assert {id(p) for p in router_group["params"]} == expected and router_group["weight_decay"] == 0.0
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert not decayed & expected
    assert all(b.attn.q_proj.weight.shape[0] == 32 for b in model.blocks)  # q_proj itself keeps its shape


def test_positions_set_the_rotary_angles():
    """RoPE is relative: shifting every position leaves the logits (nearly) unchanged, while positions that
    are not consecutive change them."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(d_model=32, n_layers=2, n_heads=4))
    ids = torch.randint(0, 256, (2, 12))
    base = model(ids).logits
    assert torch.allclose(model(ids, positions=torch.arange(100, 112)).logits, base, atol=1e-5)
    assert torch.equal(model(ids, positions=torch.arange(12)).logits, base)
    spread = model(ids, positions=torch.arange(12) * 3).logits
    assert (spread - base).abs().max() > 1e-4  # 10x the float noise of the shifted run, at this random init
    for bad in (dict(positions=torch.arange(11)), dict(positions=torch.arange(12), cache=model.new_cache()),
                dict(positions=torch.arange(12.0)),
                dict(positions=torch.arange(12), segment_starts=torch.zeros_like(ids))):
        with pytest.raises(ValueError, match="positions must be"):
            model(ids, **bad)
