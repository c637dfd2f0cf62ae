"""Every mechanism on a CUDA device against the CPU fp32 reference (skipped without one): each registered
kind inside a Decoder (logits, gradients, cached greedy decoding), the sparse patterns' FlexAttention path
(fp32 and bf16, segments, KV cache), the AA-MoE op, and ring attention and FSDP2 (bf16, sharded checkpoint)
in a one-rank NCCL group.

``ALLHERE_GPU_TEST_DEVICE=cpu python3 -m pytest -q tests/mechanisms/test_gpu_mechanisms.py`` runs these tests on the
CPU to check the tests themselves (FlexAttention has no backward on the CPU: its gradients are then not
checked; the patterns' default backend there is the block-sparse op, not FlexAttention).

Ring attention runs with one rank only: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and
gloo moves CUDA tensors in broadcast and all-reduce only, not point to point. With one rank the ring
still plans, masks, merges and runs its backward on the device; the transfers are tested on CPU
(tests/distributed/test_distributed_ring.py).
"""

import copy
import os

import pytest
import torch

import allhere.registry as registry
from allhere import Decoder, ModelConfig, use_backend
from allhere.distributed import layouts
from allhere.losses import training_loss
from allhere.masks import (
    and_masks,
    dense_mask,
    longformer,
    sliding_with_sinks,
    starts_from,
    within_segments,
)
from allhere.mechanisms import (
    AAMoEConfig,
    AHAConfig,
    AllAttentionConfig,
    AttentionCall,
    AttentionDims,
    BigBirdConfig,
    DARConfig,
    DARLatentConfig,
    DilatedConfig,
    FullConfig,
    LongformerConfig,
    SinksConfig,
    SlidingConfig,
    mechanism_layers,
)
from allhere.mechanisms.masked_base import PatternAttention
from allhere.ops.aamoe import aamoe_attention, aamoe_attention_reference
from allhere.ops.aha import aha_attention
from allhere.ops.full import (
    causal_attention,
    masked_attention,
    pattern_attention_reference,
)
from allhere.ops.sliding import sliding_window_attention
from allhere.ops.ste import straight_through

from aamoe_cases import random_case
from helpers import rel_err

DEVICE = os.environ.get("ALLHERE_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (ALLHERE_GPU_TEST_DEVICE=cpu checks the tests on the CPU)")]
if ON_CUDA:
    pytestmark.append(pytest.mark.gpu)
FLEX_GRADS = ON_CUDA  # FlexAttention has no backward on the CPU
FP32, BF16 = 1e-4, (2e-2, 3e-2)  # relative error: fp32 on the device; bf16 outputs, gradients

KINDS = {  # one tiny config per registered kind (test_every_builtin_kind_is_covered keeps it complete)
    "full": FullConfig(),
    "sliding": SlidingConfig(window=5),
    "aha": AHAConfig(window=4, router_init="neutral"),
    "dar": DARConfig(window=4, d_down=8),
    "dar_latent": DARLatentConfig(window=4, d_down=8, rope_pairs=1),
    "sinks": SinksConfig(window=4, n_sinks=2),
    "dilated": DilatedConfig(window=3, dilation=(1, 2, 3, 1)),
    "longformer": LongformerConfig(window=3, dilation=2, global_first=2, global_positions=(9,)),
    "bigbird": BigBirdConfig(block=2, window_blocks=2, global_blocks=1, random_blocks=1, seed=1),
    "all_attention": AllAttentionConfig(n_mem=8),
    "aamoe": AAMoEConfig(chunk=3, experts=2, budget=1.5),
}
LONG = {  # the patterns at sizes where q_len x kv_len > dense_below (4 query heads, 2 kv heads)
    "sinks": SinksConfig(window=48, n_sinks=4),
    "dilated": DilatedConfig(window=24, dilation=(1, 2, 3, 4)),
    "longformer": LongformerConfig(window=32, dilation=2, global_first=2, global_positions=(200,)),
    "bigbird": BigBirdConfig(block=32, window_blocks=2, global_blocks=1, random_blocks=1, seed=1, heads_per_draw=2),
}
DIMS = AttentionDims(64, 4, 2, 16)  # FlexAttention's kernel takes head dims from 16


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def outputs_and_grads(fn, tensors, dout, grads=True):
    """[out, d tensors...] of ``fn(*tensors)`` with fresh leaves; the gradient of sum(out * dout)."""
    leaves = [t.detach().clone().requires_grad_(grads and t.is_floating_point()) for t in tensors]
    with torch.set_grad_enabled(grads):
        out = fn(*leaves)
    if not grads:
        return [out.detach()]
    diff = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad((out.float() * dout.to(out.device)).sum(), diff, allow_unused=True)
    return [out.detach(), *(g for g in got if g is not None)]  # inputs a call does not read: no entry


def assert_close(got, want, tol, what=""):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        err = rel_err(a.float().cpu(), b.float().cpu())
        assert err < tol, f"{what} {'output' if i == 0 else f'gradient {i}'}: relative error {err:.2e}"


@pytest.fixture
def flex_calls(monkeypatch):
    """The calls that reach FlexAttention. Compiled code of earlier tests is dropped first: past dynamo's
    recompile limit the compiled flex_attention would silently fall back to its unfused eager form (and the
    pattern layers' count of compiled shapes, which keeps them below it, starts again)."""
    import allhere.ops.flex as flex

    torch._dynamo.reset()
    PatternAttention._flex_seen.clear()
    calls, real = [], flex.flex_pattern_attention
    monkeypatch.setattr(flex, "flex_pattern_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


# -- the training group with one rank ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_group():
    """The process group as training joins it (``allhere.distributed.env.init``: on CUDA NCCL for CUDA
    tensors and gloo for CPU ones), with one rank."""
    import socket

    from allhere.distributed.env import DistEnv, init

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or (ON_CUDA and not dist.is_nccl_available()):
        pytest.skip("torch.distributed with " + ("NCCL" if ON_CUDA else "gloo") + " is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    init(DistEnv(0, 1, 0), DEVICE)
    yield
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_the_training_group_reduces_cpu_and_device_tensors(one_rank_group):
    """What training sends through the group: the logged sums (CPU tensors) and, in context parallelism,
    values on the device."""
    import torch.distributed as dist

    from allhere.distributed.context import mean_over_ranks

    for device in ("cpu", DEVICE):
        t = torch.tensor([1.5, 2.0], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        assert t.tolist() == [1.5, 2.0]
    assert mean_over_ranks(torch.tensor(3.0, device=DEVICE)) == 3.0 and mean_over_ranks(2.5) == 2.5


# -- FSDP2 in a one-rank group (first: nothing to compile) ---------------------------------------------------


def full_optimizer_state(model, optimizer) -> dict:
    """{parameter name: the optimizer's state of it, gathered whole}."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return sd["state"]


def test_fsdp2_step_and_sharded_checkpoint_on_one_rank(one_rank_group, tmp_path):
    """FSDP2 as training shards a Decoder (each block, then the root; on CUDA bf16 parameters with fp32
    gradient reduction over NCCL, on the CPU fp32 over gloo): one step's loss and every gradient against
    the unsharded fp32 model on the same device; then the sharded checkpoint (DCP) after an optimizer step,
    read back into a differently initialised sharded model, and its export to one file."""
    from allhere.distributed import sharded_checkpoint as sharded
    from allhere.distributed.env import DistEnv
    from allhere.distributed.fsdp import shard_model
    from allhere.runtime.model_checkpoint import load_model

    cfg = ModelConfig(vocab_size=40, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      mechanism=SlidingConfig(window=5))  # no router: bf16 cannot flip a gate here
    torch.manual_seed(0)
    plain = Decoder(cfg).to(DEVICE)
    fsdp = shard_model(copy.deepcopy(plain), DEVICE)
    ids = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    losses, grads = [], []
    for model in (plain, fsdp):
        loss = training_loss(model.train()(ids), ids, lam=0.01).total
        loss.backward()
        losses.append(loss.detach().float().cpu().reshape(1))
        grads.append({n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in model.named_parameters()})
    tol = BF16 if ON_CUDA else (FP32, FP32)
    assert_close(losses[1:], losses[:1], tol[0], "FSDP2 loss")
    assert grads[1].keys() == grads[0].keys()
    for name, want in grads[0].items():
        assert_close([grads[1][name]], [want], tol[1], f"FSDP2 gradient of {name}")

    env, ckpt = DistEnv(0, 1, 0), tmp_path / "checkpoint.safetensors"
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    opt.step()
    sharded.save(ckpt, fsdp, opt, {"step": 1}, env)
    torch.manual_seed(5)
    other = shard_model(Decoder(cfg).to(DEVICE), DEVICE)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert sharded.load(ckpt, other, other_opt, env)["step"] == 1
    want, got = sharded.full_state_dict(fsdp), sharded.full_state_dict(other)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    opt_want, opt_got = (full_optimizer_state(m, o) for m, o in ((fsdp, opt), (other, other_opt)))
    assert opt_got.keys() == opt_want.keys() and len(opt_want) == len(want)
    for name, state in opt_want.items():  # Adam's moments after one step: not the zeros of a fresh optimizer
        assert state["exp_avg"].abs().sum() > 0
        assert all(torch.equal(opt_got[name][k], v) for k, v in state.items()), name
    sharded.export(ckpt, other, {"step": 1}, env)
    exported = load_model(ckpt)[0].state_dict()
    assert all(torch.equal(exported[k].cpu(), want[k].cpu()) for k in want)


# -- every registered kind inside a Decoder ------------------------------------------------------------------


def test_every_builtin_kind_is_covered():
    builtin = {k for k in registry.kinds() if registry.get(k).module.__module__.startswith("allhere.")}
    assert set(KINDS) == builtin


def pair(kind):
    """(CPU model, the same weights on the device)."""
    torch.manual_seed(0)
    cpu = Decoder(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mechanism=KINDS[kind]))
    if kind == "aha":  # router scores far from tau: no gate flips on a rounding difference between devices
        for m in mechanism_layers(cpu):
            torch.nn.init.normal_(m.router.weight, std=1.0)
    return cpu, copy.deepcopy(cpu).to(DEVICE)


@pytest.mark.parametrize("kind", KINDS)
def test_decoder_logits_and_gradients_match_cpu(kind):
    """Training forward + backward (LM loss, lambda * L_reg, the mechanisms' aux losses): the same logits,
    finite gradients equal to the CPU's for every parameter. The patterns also through their block-sparse
    op on the device (at this size they take the dense path)."""
    cpu, dev = pair(kind)
    ids = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(1))
    logits, grads = [], []
    for model in (cpu, dev):
        x = ids.to(next(model.parameters()).device)
        out = model.train()(x)
        training_loss(out, x, lam=0.01).total.backward()
        logits.append(out.logits.detach())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert_close(logits[1:], logits[:1], FP32, kind)
    for name, want in grads[0].items():
        got = grads[1][name]
        assert (got is None) == (want is None), name
        if want is not None:
            assert torch.isfinite(got).all(), name
            assert rel_err(got.cpu(), want) < FP32 or (got.cpu() - want).abs().max() < 1e-7, name
    patterns = [m for m in mechanism_layers(dev) if isinstance(m, PatternAttention)]
    if patterns:
        for m in patterns:
            m.dense_below = 0
        with torch.no_grad(), use_backend("torch"):  # the block-sparse op
            assert_close([dev.eval()(ids.to(DEVICE)).logits], logits[:1], FP32, f"{kind} block-sparse")


def cached_logits(model, ids, prompt):
    cache = model.new_cache()
    parts = [model(ids[:, :prompt], cache=cache).logits]
    parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(prompt, ids.shape[1])]
    return torch.cat(parts, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_greedy_decoding_matches_cpu(kind):
    cpu, dev = pair(kind)
    prompt = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = cpu.eval().generate(prompt, 12)
        got = dev.eval().generate(prompt.to(DEVICE), 12)
        assert torch.equal(got.cpu(), want)
        assert_close([cached_logits(dev, want.to(DEVICE), 7)], [cached_logits(cpu, want, 7)], FP32, kind)


def test_decoder_patterns_default_backend_at_length(flex_calls):
    """One layer of each pattern at 320 tokens (q_len x kv_len > dense_below): on CUDA the default backend
    ("auto") runs FlexAttention in every layer; logits and gradients equal the CPU's dense reference."""
    torch.manual_seed(0)
    cpu = Decoder(ModelConfig(vocab_size=40, d_model=DIMS.d_model, n_layers=4, n_heads=DIMS.n_heads,
                              n_kv_heads=DIMS.kv_heads, layer_mechanisms=tuple(LONG.values())))
    dev = copy.deepcopy(cpu).to(DEVICE)
    ids = torch.randint(0, 40, (1, 320), generator=torch.Generator().manual_seed(3))
    results = []
    for model, backend in ((cpu, "reference"), (dev, "auto")):
        x = ids.to(next(model.parameters()).device)
        with use_backend(backend):
            out = model.train()(x)
            training_loss(out, x, lam=0.0).total.backward()
        results.append([out.logits.detach()] + [p.grad for p in model.parameters()])
    assert len(flex_calls) == (len(LONG) if ON_CUDA else 0)
    assert all(torch.isfinite(g).all() for g in results[1][1:])
    assert_close(results[1], results[0], FP32, "patterns at 320 tokens")


# -- the patterns' FlexAttention path ------------------------------------------------------------------------


def flex_mech(name):
    return registry.build(LONG[name], DIMS).to(DEVICE)  # run under use_backend("flex")


def qkv(n, b=2, seed=0):
    return randn(b, 4, n, 16, seed=seed), randn(b, 2, n, 16, seed=seed + 1), randn(b, 2, n, 16, seed=seed + 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", LONG)
def test_flex_path_matches_dense_reference(name, dtype, flex_calls):
    n = 384
    q, k, v = qkv(n)
    dout = randn(2, 4, n, 16, seed=9)
    want = outputs_and_grads(lambda *t: pattern_attention_reference(*t, LONG[name].mask_fn(n)), (q, k, v), dout)
    mech = flex_mech(name)
    with use_backend("flex"):
        got = outputs_and_grads(lambda *t: mech(*t, AttentionCall(x=None))[0],
                                [t.to(DEVICE, dtype) for t in (q, k, v)], dout, FLEX_GRADS)
    assert len(flex_calls) == 1
    tol = FP32 if dtype == torch.float32 else BF16[0]
    assert_close(got[:1], want[:1], tol, f"{name} {dtype}")
    assert_close(got[1:], want[1:len(got)], FP32 if dtype == torch.float32 else BF16[1], f"{name} {dtype}")


@pytest.mark.parametrize("name", list(LONG))
def test_flex_path_with_segments(name, flex_calls):
    """Row 0: two packed documents (from 0 and from 150); row 1: 40 padding positions, then one document."""
    n = 384
    q, k, v = qkv(n, seed=3)
    dout = randn(2, 4, n, 16, seed=9)
    pos = torch.cat([torch.arange(150), torch.arange(n - 150)])[None]
    starts = torch.cat([starts_from(position_ids=pos), starts_from(padding_mask=(torch.arange(n) >= 40)[None])])
    pred = and_masks(LONG[name].mask_fn(n), within_segments(starts))
    want = outputs_and_grads(lambda *t: pattern_attention_reference(*t, pred), (q, k, v), dout)
    mech = flex_mech(name)
    call = AttentionCall(x=None, segment_starts=starts.to(DEVICE))
    with use_backend("flex"):
        got = outputs_and_grads(lambda *t: mech(*t, call)[0], [t.to(DEVICE) for t in (q, k, v)], dout, FLEX_GRADS)
    assert len(flex_calls) == 1
    assert_close(got, want[:len(got)], FP32, name)
    assert got[0][1, :, :40].abs().max() == 0  # padding reads nothing


@pytest.mark.parametrize("name", LONG)
def test_flex_path_with_kv_cache(name, flex_calls):
    """Prefill 320 tokens, a chunk of 250, 4 decode steps: each equal to the whole sequence's reference rows.
    Both long calls run FlexAttention where the cache's keys are contiguous positions (dilated: a rolling
    window, so with a key offset; bigbird: every key, the queries the last 250); sinks and longformer keep
    scattered positions after the prefill, so their chunk takes the dense path."""
    n = 574
    q, k, v = qkv(n, b=1, seed=5)
    mech = flex_mech(name)
    cache = mech.new_cache()
    parts = []
    with torch.no_grad(), use_backend("flex"):
        for a, b in [(0, 320), (320, 570)] + [(t, t + 1) for t in range(570, n)]:
            parts.append(mech(*(t[:, :, a:b].to(DEVICE) for t in (q, k, v)), AttentionCall(x=None), cache=cache)[0])
    assert len(flex_calls) == (2 if name in ("dilated", "bigbird") else 1)
    assert_close([torch.cat(parts, 2)], [pattern_attention_reference(q, k, v, LONG[name].mask_fn(n))], FP32, name)


def test_bigbird_predicate_still_covers_longer_sequences_after_a_flex_mask():
    from allhere.ops.flex import flex_block_mask

    cfg = LONG["bigbird"]
    pred = cfg.mask_fn()
    flex_block_mask(pred, 128, 128, heads=4, device=DEVICE)
    assert torch.equal(dense_mask(pred, 256, 256, DEVICE, heads=4),
                       dense_mask(cfg.mask_fn(), 256, 256, DEVICE, heads=4))


# -- the AA-MoE op -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("own", [True, False])
def test_aamoe_op_matches_reference(own, dtype):
    """The gathered op and the dense one on the device against the dense one on the CPU (fp32): outputs and
    the gradients of q, k, v, the expert slots, log P and the memory queries."""
    q, k, v, mk, mv, choice, logp = random_case(lq=29, lk=37, m=4, e=3, k_max=3, seed=int(own), grad=False)
    q_mem = randn(*q.shape, seed=7)
    tensors = (q, k, v, mk, mv, logp, q_mem)
    dout = randn(*q.shape, seed=8)

    def op(fn, choice):
        return lambda q, k, v, mk, mv, logp, q_mem: fn(q, k, v, mk, mv, choice, logp, 4, own, q_mem=q_mem)

    want = outputs_and_grads(op(aamoe_attention_reference, choice), tensors, dout)
    on_dev = [t.to(DEVICE, dtype if i < 5 or i == 6 else torch.float32) for i, t in enumerate(tensors)]
    for fn in (aamoe_attention, aamoe_attention_reference):
        got = outputs_and_grads(op(fn, choice.to(DEVICE)), on_dev, dout)
        assert all(torch.isfinite(g).all() for g in got)
        if dtype == torch.float32:
            assert_close(got, want, FP32, fn.__name__)
        else:
            assert_close(got[:1], want[:1], BF16[0], fn.__name__)
            assert_close(got[1:], want[1:], BF16[1], fn.__name__)


# -- ring attention in a one-rank group (its fixture is above, with FSDP2's test) ----------------------------


RING_N, RING_W, RING_TAU = 64, 5, 0.7
RING_KINDS = ["full", "sliding", "longformer", "sinks", "aha", "aha_ste"]


def ring_global(n):
    g = torch.zeros(n, dtype=torch.bool)
    g[[0, n // 2 + 1]] = True
    return g


def ring_call(kind, layout, ring):
    """(q, k, v, scores) -> attention: the ring (``ring=True``) or the single-process op."""
    from allhere.distributed import ring_aha_attention, ring_attention

    preds = {"longformer": longformer(RING_W, ring_global(RING_N)), "sinks": sliding_with_sinks(RING_W, 2)}

    def fn(q, k, v, s):
        if kind.startswith("aha"):
            gate = straight_through(s, RING_TAU) if kind == "aha_ste" else s.detach() > RING_TAU
            return (ring_aha_attention(q, k, v, gate, RING_W, layout=layout) if ring
                    else aha_attention(q, k, v, gate, RING_W))
        if ring:
            from allhere.distributed import sliding

            pattern = {"full": None, "sliding": sliding(RING_W)}.get(kind, preds.get(kind))
            return ring_attention(q, k, v, pattern, layout=layout)
        if kind == "full":
            return causal_attention(q, k, v)
        if kind == "sliding":
            return sliding_window_attention(q, k, v, RING_W)
        return masked_attention(q, k, v, dense_mask(preds[kind], RING_N, RING_N))

    return fn


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_on_one_rank_matches_single_process(kind, layout, one_rank_group):
    n = RING_N
    q, k, v = randn(2, 4, n, 8, seed=0), randn(2, 2, n, 8, seed=1), randn(2, 2, n, 8, seed=2)
    scores, dout = torch.rand(2, 4, n, generator=torch.Generator().manual_seed(3)), randn(2, 4, n, 8, seed=4)
    with use_backend("reference"):
        want = outputs_and_grads(ring_call(kind, layout, False), (q, k, v, scores), dout)
    sh = lambda x: layouts.shard(x, layout, 1, 0).to(DEVICE)  # noqa: E731  (one rank: the whole sequence)
    got = outputs_and_grads(ring_call(kind, layout, True), [sh(t) for t in (q, k, v, scores)], sh(dout))
    got = [layouts.unshard([g.cpu()], layout) for g in got]
    assert len(got) == len(want) == (5 if kind == "aha_ste" else 4)
    assert_close(got, want, FP32, f"{kind} {layout}")

