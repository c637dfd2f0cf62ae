"""The mechanism contract: every kind the package registers (``allhere.registry.kinds()``) is held to it
through its example config (tests/mechanism_examples.py; a kind without one fails), in a tiny Decoder:

1. the full forward equals cached decoding, token by token and in chunks (or the kind's declared refusal);
2. ... with n_kv_heads = n_heads, n_heads / 2 and 1 (grouped-query attention);
3. packed documents and padded rows equal each document run alone at the positions it has in its row
   (or the declared refusal);
4. its config survives the registry's dicts, JSON, ``ModelConfig`` and a checkpoint;
5. ``swap_mechanism`` from a full-attention model keeps the shared weights and changes the output, and a
   config of the kind that computes full attention reproduces the full model;
6. the reference backend agrees with the default one: tests/mechanisms/test_backend.py (same examples);
7. context parallelism: the plan the kind declares computes what its forward computes (evaluated densely
   in one process), or the kind's declared refusal.
"""

import dataclasses
import json

import pytest
import torch

from allhere import Decoder, FullConfig, ModelConfig, registry, swap_mechanism
from allhere.distributed.context import check_supported
from allhere.masks import dense_mask, starts_from
from allhere.mechanisms import ContextParallelPlan, mechanism_layers
from allhere.ops.common import default_scale, repeat_kv
from allhere.runtime.model_checkpoint import load_model, save_checkpoint

from helpers import rel_err
from mechanism_examples import (
    CAUSAL_MODE,
    EXAMPLES,
    FULL_EQUIVALENT,
    REFUSALS,
    builtin_kinds,
    contract_cases,
    example,
    refusal,
)

KINDS = builtin_kinds()
CASES = contract_cases()  # the kinds and their variants
VOCAB, N, TOL = 61, 40, 1e-5


def tiny(mech, kv_heads=2):
    """A 2-layer Decoder (d_model 32, 4 query heads) of ``mech`` (a config, or a kind's example), in eval mode,
    its mechanisms' own weights moved off their initialisation as training moves them (AA-MoE's budget
    weights start at zero: its budgets would all be equal)."""
    cfg = example(mech) if isinstance(mech, str) else mech
    model = Decoder(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads,
                                mechanism=cfg))
    with torch.no_grad():
        for p in (p for m in mechanism_layers(model) for p in m.parameters()):
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def tokens(*shape):
    return torch.randint(0, VOCAB, shape)


def test_every_builtin_kind_has_an_example_and_declarations_name_kinds():
    assert sorted(KINDS) == sorted(EXAMPLES), "give every registered kind an example in tests/mechanism_examples.py"
    assert set(REFUSALS) | set(CAUSAL_MODE) | set(FULL_EQUIVALENT) <= set(KINDS)
    assert {item for r in REFUSALS.values() for item in r} <= {"cache", "packed", "context_parallel"}
    for kind, cfg in FULL_EQUIVALENT.items():
        assert cfg.kind == kind


# -- 1, 2: cached decoding, with grouped-query attention --------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", CASES)
def test_full_forward_equals_cached_decoding(kind, kv_heads):
    """Token by token, then chunks that cut windows, blocks and chunks mid-way followed by single steps: the
    logits (and a routed kind's gates) of the full forward."""
    model = tiny(kind, kv_heads)
    ids = tokens(2, N)
    refused = refusal(kind, "cache")
    if refused is not None:
        with refused, torch.no_grad():
            model(ids, cache=model.new_cache())
        return
    CAUSAL_MODE.get(kind, lambda m: None)(model)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, t:t + 1], cache=cache) for t in range(N)]
        assert rel_err(torch.cat([s.logits for s in steps], 1), full.logits) < TOL
        if full.routing is not None:
            for li in range(len(full.routing.layers)):
                gates = torch.cat([s.routing.per_layer[li].gates for s in steps], dim=2)
                assert torch.equal(gates, full.routing.per_layer[li].gates)
        cache = model.new_cache()
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 13), (13, 21), (21, 30))]
        parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(30, N)]
        assert rel_err(torch.cat(parts, 1), full.logits) < TOL


# -- 3: packed documents and padding ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", CASES)
def test_packed_documents_and_padding_equal_each_document_alone(kind):
    """``segment_starts``: each packed document, and a row's real tokens beside left or right padding, give
    what the document gives alone at the positions it has in the row (patterns place sinks, globals and
    blocks at absolute row positions, docs/patterns.md), and the first document at 0 what it gives alone.
    Padding rows stay finite."""
    model = tiny(kind)
    docs = [tokens(n) for n in (11, 7, 13)]
    packed = torch.cat(docs)[None]
    starts = starts_from(position_ids=torch.cat([torch.arange(len(d)) for d in docs])[None])
    refused = refusal(kind, "packed")
    if refused is not None:
        with refused, torch.no_grad():
            model(packed, segment_starts=starts)
        return
    with torch.no_grad():
        out = model(packed, segment_starts=starts).logits[0]
        at = 0
        for d in docs:
            alone = model(d[None], positions=torch.arange(at, at + len(d))).logits[0]
            assert rel_err(out[at:at + len(d)], alone) < TOL, at
            at += len(d)
        assert rel_err(out[:len(docs[0])], model(docs[0][None]).logits[0]) < TOL
        pad, doc = 5, docs[2]
        zeros = torch.zeros(pad, dtype=torch.long)
        batch = torch.stack([torch.cat([zeros, doc]), torch.cat([doc, zeros])])
        real = torch.ones_like(batch, dtype=torch.bool)
        real[0, :pad] = real[1, -pad:] = False
        out = model(batch, segment_starts=starts_from(padding_mask=real)).logits
        assert torch.isfinite(out).all()
        assert rel_err(out[0, pad:], model(doc[None], positions=torch.arange(pad, pad + len(doc))).logits[0]) < TOL
        assert rel_err(out[1, :-pad], model(doc[None]).logits[0]) < TOL


# -- 4: configuration round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", CASES)
def test_config_round_trips(kind, tmp_path):
    cfg = example(kind)
    mech = registry.get(cfg.kind)
    assert type(cfg) is mech.config and registry.of(cfg) is mech and mech.summary
    d = registry.to_dict(cfg)
    assert d["kind"] == cfg.kind
    assert registry.from_dict(d) == cfg
    assert registry.from_dict(json.loads(json.dumps(d))) == cfg
    mixed = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        layer_mechanisms=(cfg, FullConfig()))
    assert ModelConfig.from_dict(json.loads(json.dumps(mixed.to_dict()))) == mixed
    model = tiny(kind)
    ids = tokens(2, 12)
    save_checkpoint(tmp_path / "m.safetensors", model, None, {"step": 0})
    again, _ = load_model(tmp_path / "m.safetensors")
    assert again.cfg == model.cfg
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, model(ids).logits)


# -- 5: swapping a full-attention model's mechanism --------------------------------------------------------------


@pytest.mark.parametrize("kind", CASES)
def test_swap_from_full_keeps_the_weights(kind):
    """Every weight the swapped model shares with the full model is the full model's, only the mechanism's
    own are new; the only ones left behind are the MLPs of a kind that replaces them. The example changes
    the output (a kind other than full); the kind's full-attention config reproduces it; swapping back to
    full restores the model, or is refused where the MLP is gone."""
    base = tiny(FullConfig())
    ids = tokens(2, N)
    swapped = swap_mechanism(base, example(kind)).eval()
    src, dst = base.state_dict(), swapped.state_dict()
    for name, t in dst.items():
        if name in src:
            assert torch.equal(t, src[name]), name
        else:
            assert ".mechanism." in name, name
    replaces_mlp = mechanism_layers(swapped)[0].replaces_mlp
    left = {name.split(".")[2] for name in set(src) - set(dst)}
    assert left == ({"mlp_norm", "gate_up", "down"} if replaces_mlp else set())
    with torch.no_grad():
        want = base(ids).logits
        got = swapped(ids).logits
        assert got.shape == want.shape and torch.isfinite(got).all()
        if kind != "full":
            assert rel_err(got, want) > 1e-3
        if kind in FULL_EQUIVALENT:
            assert rel_err(swap_mechanism(base, FULL_EQUIVALENT[kind]).eval()(ids).logits, want) < TOL
        if replaces_mlp:
            with pytest.raises(ValueError, match="cannot carry weight 'blocks.0.mlp_norm.weight'"):
                swap_mechanism(swapped, FullConfig())
        else:
            assert torch.equal(swap_mechanism(swapped, FullConfig()).eval()(ids).logits, want)


# -- 7: context parallelism -------------------------------------------------------------------------------------


def plan_output(plan: ContextParallelPlan, q, k, v, scale):
    """What ``plan`` declares for one process holding the whole sequence, computed densely in fp32: the
    keys of ``reads`` (of ``local`` where the gate is 0), through ``scores`` when given, the keys outside
    ``far.near`` rebuilt by ``far.expand`` from the payload."""
    b, h, n = q.shape[:3]
    grid = lambda pred: dense_mask(pred, n, n, batch=b, heads=h)  # noqa: E731
    allowed = grid(plan.reads)
    if plan.gate is not None:
        allowed = torch.where(plan.gate.bool()[..., None], allowed, grid(plan.local))
    pos = torch.arange(n)
    qf = q.float()

    def logits(keys):
        keys = repeat_kv(keys, h).float()
        if plan.scores is None:
            return qf @ keys.transpose(-1, -2) * scale
        return plan.scores(qf, keys, pos.view(1, 1, -1, 1), pos.view(1, 1, 1, -1), scale)

    s, near = logits(k), torch.ones_like(allowed)
    if plan.far is not None:
        k_far, v_far = plan.far.expand(plan.far.payload, pos)
        near = torch.zeros_like(allowed) if plan.far.near is None else grid(plan.far.near)
        s = torch.where(near, s, logits(k_far))
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)  # every query reads itself
    out = (p * near) @ repeat_kv(v, h).float()
    if plan.far is not None:
        out = out + (p * ~near) @ repeat_kv(v_far, h).float()
    return out


@pytest.mark.parametrize("kind", CASES)
def test_context_parallel_plan_computes_the_forward_or_is_refused(kind):
    model = tiny(kind)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, kw, out: seen.append((mod, args, out[0])), with_kwargs=True)
             for m in mechanism_layers(model)]
    with torch.no_grad():
        model(tokens(2, N))
    for hook in hooks:
        hook.remove()
    assert len(seen) == 2
    declared = REFUSALS.get(kind, {}).get("context_parallel")
    for i, (mech, (q, k, v, call), out) in enumerate(seen):
        whole = dataclasses.replace(call, positions=torch.arange(N))  # one rank holding every position
        why = mech.context_parallel_refusal()
        if declared is not None:
            assert isinstance(why, str) and why and "\n" not in why
            with refusal(kind, "context_parallel"):
                mech.context_parallel_plan(whole, N)
            continue
        assert why is None
        with torch.no_grad():
            plan = mech.context_parallel_plan(whole, N)
            assert isinstance(plan, ContextParallelPlan)
            assert rel_err(plan_output(plan, q, k, v, default_scale(q.shape[-1], call.scale)), out) < TOL, i
    if declared is not None:
        name = type(seen[0][0]).__name__
        with pytest.raises(NotImplementedError, match=f"layer 0: {name} \\({kind}\\): .*{declared[1]}"):
            check_supported(model)
    else:
        check_supported(model)
