"""The AA-MoE layer: routing and log P against a brute-force reading of Eqs. 4-16, every decision switch,
the causal budget predictor, cached decoding equal to the full forward, the config checks."""

import copy
import math

import pytest
import torch

from allhere import ConfigError, Decoder, ModelConfig, use_backend
from allhere.losses import training_loss
from allhere.mechanisms.aamoe import AAMoEAttention, AAMoEConfig, set_budget_source
from allhere.mechanisms.base import AttentionCall, AttentionDims
from allhere.model import apply_rope, rope_cos_sin
from allhere.ops.full import masked_attention

from aamoe_cases import brute_force
from helpers import rel_err

D, H, HKV, HD = 16, 2, 1, 8


def layer(seed=0, w_b=1.0, **kw):
    torch.manual_seed(seed)
    m = AAMoEAttention(AAMoEConfig(**{"chunk": 3, "experts": 2, **kw}), AttentionDims(D, H, HKV, HD))
    with torch.no_grad():
        m.w_b.weight.normal_(0.0, w_b)
    return m


def inputs(n=10, seed=1, b=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, D, generator=g)
    q, k, v = (torch.randn(b, H, n, HD, generator=g), torch.randn(b, HKV, n, HD, generator=g),
               torch.randn(b, HKV, n, HD, generator=g))
    return q, k, v, x


def brute_force_layer(m, q, k, v, x):
    """Eqs. 4-16 token by token: budget, available resources, top-B_i, log P, then the attention."""
    cfg = m.cfg
    b, n, d = x.shape
    mc = cfg.chunk
    n_chunks = -(-n // mc)
    cos, sin = rope_cos_sin(torch.arange(n), d, cfg.rope_theta)
    rot = lambda t: apply_rope(t[:, None], cos, sin)[:, 0]  # noqa: E731
    hq, hc = rot(m.w_c(x)), rot(x)
    u = m.w_b(x)[..., 0]
    share = cfg.budget * n * torch.softmax(u, -1)
    k_max = 1 + int(share.max())
    choice = torch.full((b, n, k_max), -1, dtype=torch.long)
    logp = torch.zeros(b, n, k_max)
    for bi in range(b):
        for i in range(n):
            budget = math.floor(float(share[bi, i]) + 1e-4)
            options = {j: float(hq[bi, i] @ hc[bi, j * mc + mc - 1]) / math.sqrt(d) for j in range(i // mc)}
            options.update({n_chunks + e: float(x[bi, i] @ m.expert_emb[e]) / math.sqrt(d) for e in range(cfg.experts)})
            ranked = sorted(options, key=options.get, reverse=True)[:budget]
            pool = ranked if cfg.router_softmax == "chosen" else list(options)
            lse = torch.logsumexp(torch.tensor([options[o] for o in pool]), 0) if pool else 0.0
            s = float(share[bi, i]) if cfg.sigmoid_budget == "continuous" else float(budget)
            for r, o in enumerate(ranked):
                choice[bi, i, r] = o
                logp[bi, i, r] = math.log(1 / (1 + math.exp(-(s - (r + 1))))) + options[o] - lse
    q_mem = apply_rope(q, *rope_cos_sin(-torch.arange(n), HD, cfg.rope_theta))  # experts read unrotated queries
    return brute_force(q, k, v, m.mem_k, m.mem_v, choice, logp, mc, cfg.own_chunk == "always", q_mem)


@pytest.mark.parametrize("kw", [{}, {"own_chunk": "never", "router_softmax": "chosen"},
                                {"sigmoid_budget": "floored", "budget": 1.5}])
def test_layer_equals_brute_force(kw):
    m = layer(**kw)
    q, k, v, x = inputs()
    with torch.no_grad():
        out, routing = m(q, k, v, AttentionCall(x=x))
        with use_backend("reference"):
            ref_op, _ = m(q, k, v, AttentionCall(x=x))
        truth = brute_force_layer(m, q, k, v, x)
    assert routing is None
    assert rel_err(out, truth) < 1e-5 and rel_err(ref_op, truth) < 1e-5


def test_zero_budget_own_chunk_switch():
    """budget 0.4 per token with w_B = 0: every B_i = 0. "never": nothing is read (output 0, the residual
    passes); "always": exactly causal attention inside the own chunk."""
    q, k, v, x = inputs()
    never = layer(w_b=0.0, budget=0.4, own_chunk="never")
    out, _ = never(q, k, v, AttentionCall(x=x))
    assert torch.equal(out, torch.zeros_like(out))
    always = layer(w_b=0.0, budget=0.4, own_chunk="always")
    out, _ = always(q, k, v, AttentionCall(x=x))
    i, j = torch.arange(10)[:, None], torch.arange(10)[None]
    assert rel_err(out, masked_attention(q, k, v, (j <= i) & (i // 3 == j // 3))) < 1e-6


def test_budget_is_per_token_at_any_length():
    for n in (12, 24):
        m = layer(w_b=0.0, budget=2.0)
        m.record = True
        q, k, v, x = inputs(n=n)
        m(q, k, v, AttentionCall(x=x))
        assert torch.equal(m.stats["budget"], torch.full((2, n), 2))


def grads(m, names, x_grad=False):
    q, k, v, x = inputs()
    x.requires_grad_(x_grad)
    out, _ = m(q, k, v, AttentionCall(x=x))
    out.pow(2).sum().backward()
    params = dict(m.named_parameters())
    return [params[n].grad for n in names], out.detach(), x.grad


@pytest.mark.parametrize("mode,w_b_learns", [("continuous", True), ("floored", False), ("straight_through", True)])
def test_sigmoid_budget_switch(mode, w_b_learns):
    (g,), out, _ = grads(layer(sigmoid_budget=mode, budget=1.5), ["w_b.weight"])
    learns = g is not None and g.abs().sum() > 0
    assert learns == w_b_learns
    if mode == "straight_through":  # the forward is the floored one
        _, floored, _ = grads(layer(sigmoid_budget="floored", budget=1.5), ["w_b.weight"])
        assert torch.equal(out, floored)


@pytest.mark.parametrize("scope,router_learns", [("available", True), ("chosen", False)])
def test_router_softmax_switch(scope, router_learns):
    """B_i <= 1 everywhere: over the chosen ones log softmax(r) is log 1 = 0, the router gets no gradient;
    over the available ones it does."""
    m = layer(w_b=0.0, budget=1.0, router_softmax=scope)
    g, _, _ = grads(m, ["w_c.weight", "expert_emb"])
    assert all((t is not None and t.abs().sum() > 0) == router_learns for t in g)


@pytest.mark.parametrize("trunk", [False, True])
def test_learned_predictor_trains_and_trunk_switch(trunk):
    """Training with sequence budgets leaves the predictor's loss in ``aux_loss``; its input is detached
    unless predictor_trains_trunk."""
    m = layer(predictor_trains_trunk=trunk, predictor_weight=1.0)
    with torch.no_grad():
        m.predictor.net[2].weight.normal_()
    q, k, v, x = inputs()
    x.requires_grad_(True)
    out, _ = m(q, k, v, AttentionCall(x=x))
    m.aux_loss.backward()
    assert m.predictor.net[0].weight.grad.abs().sum() > 0
    assert (x.grad is not None and bool(x.grad.abs().sum() > 0)) == trunk
    m.eval()
    with torch.no_grad():  # no predictor loss at evaluation: the output is the attention
        assert torch.equal(m(q, k, v, AttentionCall(x=x))[0], out.detach())
        assert m.aux_loss is None


def test_predictor_loss_is_in_the_total_and_scales_with_it():
    """The decoder hands the predictor's loss to ``training_loss``; backpropagating total / 2 (two
    accumulated micro-batches) halves the predictor's gradient as it halves the LM's."""
    cfg = ModelConfig(vocab_size=20, d_model=D, n_layers=1, n_heads=H, n_kv_heads=HKV,
                      mechanism=AAMoEConfig(chunk=3, experts=2, predictor_weight=1.0))
    torch.manual_seed(0)
    model = Decoder(cfg).train()
    pred = model.blocks[0].attn.mechanism.predictor
    torch.nn.init.normal_(pred.net[2].weight)
    ids = torch.randint(0, 20, (2, 12))
    grads = []
    for scale in (1.0, 0.5):
        model.zero_grad()
        out = model(ids)
        loss = training_loss(out, ids, lam=0.0)
        assert out.aux_loss is not None and torch.allclose(loss.total, loss.lm + out.aux_loss)
        assert model.blocks[0].attn.mechanism.aux_loss is None  # handed on, not kept: the model deep-copies
        copy.deepcopy(model)
        (loss.total * scale).backward()
        grads.append(pred.net[0].weight.grad.clone())
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[1], grads[0] / 2, atol=1e-7)


def test_memory_reads_the_query_rotated_back_from_the_given_positions():
    """Queries rotated at ``AttentionCall.positions`` (a shard of a longer sequence) read the experts as the
    same queries at the default positions: the memory does not depend on where the query sits."""
    m = layer(budget=1.0, route_context=False)  # experts only: no context chunk in play
    q, k, v, x = inputs(n=6)
    pos = torch.arange(6) + 30
    shift = lambda t, p: apply_rope(t, *rope_cos_sin(p, HD, m.cfg.rope_theta))  # noqa: E731
    with torch.no_grad():
        base, _ = m(q, k, v, AttentionCall(x=x))
        moved, _ = m(shift(q, pos - torch.arange(6)), shift(k, pos - torch.arange(6)), v,
                     AttentionCall(x=x, positions=pos))
        wrong, _ = m(shift(q, pos - torch.arange(6)), shift(k, pos - torch.arange(6)), v, AttentionCall(x=x))
    assert rel_err(moved, base) < 1e-5
    assert rel_err(wrong, base) > 1e-2


@pytest.mark.parametrize("predictor", ["learned", "prefix"])
def test_predictor_budgets_are_causal_sequence_budgets_are_not(predictor):
    m = layer(predictor=predictor, budget=1.5).eval()
    q, k, v, x = inputs(n=12)
    q2, k2, v2, x2 = (t.clone() for t in (q, k, v, x))
    x2[:, -1] += 3.0  # change the last token only
    for source, causal in (("predictor", True), ("sequence", False)):
        m.budget_source = source
        a, _ = m(q, k, v, AttentionCall(x=x))
        b, _ = m(q2, k2, v2, AttentionCall(x=x2))
        assert torch.equal(a[:, :, :-1], b[:, :, :-1]) == causal


def test_prefix_predictor_is_the_running_softmax():
    m = layer(predictor="prefix", budget=2.0).eval()
    m.record, m.budget_source = True, "predictor"
    q, k, v, x = inputs(n=9)
    m(q, k, v, AttentionCall(x=x))
    u = m.w_b(x)[..., 0].detach()
    expect = [[math.floor(2.0 * (i + 1) * float(torch.softmax(u[b, :i + 1], 0)[-1]) + 1e-4) for i in range(9)]
              for b in range(2)]
    assert m.stats["budget"].tolist() == expect


def decoder(**kw):
    torch.manual_seed(0)
    mech = AAMoEConfig(**{"chunk": 3, "experts": 2, "budget": 1.5, **kw})
    return Decoder(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mechanism=mech)).eval()


@pytest.mark.parametrize("kw", [{}, {"own_chunk": "never", "predictor": "prefix"}, {"route_context": False}])
def test_cache_equals_full_forward_with_predictor_budgets(kw):
    model = decoder(**kw)
    for blk in model.blocks:
        torch.nn.init.normal_(blk.attn.mechanism.w_b.weight)
        if blk.attn.mechanism.predictor is not None:
            torch.nn.init.normal_(blk.attn.mechanism.predictor.net[2].weight)
    assert not model.blocks[0].has_mlp and not hasattr(model.blocks[0], "gate_up")
    ids = torch.randint(0, 40, (2, 17))
    set_budget_source(model, "predictor")
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(17)], 1)
        cache = model.new_cache()
        pieces = torch.cat([model(ids[:, :5], cache=cache).logits, model(ids[:, 5:], cache=cache).logits], 1)
    assert rel_err(steps, full) < 1e-5 and rel_err(pieces, full) < 1e-5
    assert cache.layers[0].summaries.shape[1] == 17 // 3 and cache.layers[0].nbytes() > 0
    set_budget_source(model, "sequence")
    assert rel_err(model(ids).logits, full) > 1e-4  # sequence budgets differ: the test compares something


def test_config_checks_and_refusals():
    with pytest.raises(ConfigError, match="AAMoEConfig.chunk"):
        AAMoEConfig(chunk=0)
    with pytest.raises(ConfigError, match="AAMoEConfig.budget"):
        AAMoEConfig(budget=float("nan"))
    with pytest.raises(ConfigError, match="AAMoEConfig.experts"):
        AAMoEConfig(experts=0, route_context=False)
    with pytest.raises(ConfigError, match="AAMoEConfig.own_chunk"):
        AAMoEConfig(own_chunk="sometimes")
    with pytest.raises(ConfigError, match="AAMoEConfig.sigmoid_budget"):
        AAMoEConfig(sigmoid_budget="round")
    model = decoder()
    ids = torch.randint(0, 40, (1, 6))
    with pytest.raises(ValueError, match="segment_starts"):
        model(ids, segment_starts=torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="budget source"):
        set_budget_source(model, "oracle")
