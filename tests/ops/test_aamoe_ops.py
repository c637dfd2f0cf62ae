"""AA-MoE ops: the gathered op equals the dense reference in outputs and gradients; the reference equals
a brute-force loop over (batch, head, query); a query with nothing to read returns 0."""

import math

import pytest
import torch

from allhere.ops.aamoe import aamoe_attention, aamoe_attention_reference

from aamoe_cases import brute_force, random_case
from helpers import rel_err


@pytest.mark.parametrize("own", [True, False])
def test_reference_equals_brute_force(own):
    args = random_case(b=1, h=2, hkv=1, lq=7, lk=9, m=2, e=2, grad=False)
    q_mem = torch.randn_like(args[0])
    assert rel_err(aamoe_attention_reference(*args, 2, own), brute_force(*args, 2, own)) < 1e-6
    assert rel_err(aamoe_attention_reference(*args, 2, own, q_mem=q_mem), brute_force(*args, 2, own, q_mem)) < 1e-6


@pytest.mark.parametrize("own,lq,lk", [(True, 13, 13), (False, 13, 13), (True, 5, 14), (False, 1, 10)])
def test_gathered_equals_reference_outputs_and_grads(own, lq, lk):
    args = random_case(lq=lq, lk=lk, m=3, seed=lq + lk)
    q_mem = torch.randn_like(args[0]).requires_grad_(own)  # with and without a separate memory query
    args = (*args, q_mem) if own else args
    ref = aamoe_attention_reference(*args[:7], 3, own, q_mem=args[7] if own else None)
    out = aamoe_attention(*args[:7], 3, own, q_mem=args[7] if own else None)
    assert (out - ref).abs().max() < 1e-5
    w = torch.randn_like(ref)
    diff = [p for p in args if isinstance(p, torch.Tensor) and p.requires_grad]
    g_ref = torch.autograd.grad((ref * w).sum(), diff)
    g_out = torch.autograd.grad((out * w).sum(), diff)
    for a, b in zip(g_out, g_ref):
        assert (a - b).abs().max() < 1e-5


def assert_same_as_reference(args, m, own, q_mem=None, tol=1e-5):
    """Outputs and the gradients of every input that requires one, gathered against naive (fp32)."""
    ref = aamoe_attention_reference(*args, m, own, q_mem=q_mem)
    out = aamoe_attention(*args, m, own, q_mem=q_mem)
    assert out.dtype == args[0].dtype and (out.float() - ref.float()).abs().max() < tol
    w = torch.randn_like(ref)
    diff = [p for p in (*args, q_mem) if isinstance(p, torch.Tensor) and p.requires_grad]
    for a, b in zip(torch.autograd.grad((out.float() * w).sum(), diff), torch.autograd.grad((ref * w).sum(), diff)):
        assert (a.float() - b).abs().max() < tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("own", [True, False], ids=["own_chunk", "no_own_chunk"])
@pytest.mark.parametrize("hkv", [4, 1], ids=["mha", "gqa_4to1"])
@pytest.mark.parametrize("lq,lk", [(64, 64), (64, 70), (9, 70), (1, 33)],
                         ids=["train_T64", "prefill_partial_chunk", "piece_after_cache", "decode_one"])
def test_gathered_equals_reference_longer_sequences_more_ranks(own, hkv, lq, lk):
    """Several ranks (up to 5, chunks and experts mixed), several tiles per key block, a last chunk that is
    not full, queries that start inside a chunk."""
    args = random_case(b=2, h=4, hkv=hkv, lq=lq, lk=lk, d=8, m=4, e=3, k_max=5, seed=lq * 100 + lk)
    q_mem = torch.randn_like(args[0]).requires_grad_()
    assert_same_as_reference(args, 4, own, q_mem)
    assert_same_as_reference(args, 4, own)


def test_gathered_many_pairs_in_one_block():
    """Every query reads expert 0 at every rank it uses: one key block spread over many tiles."""
    q, k, v, mk, mv, choice, logp = random_case(b=3, lq=40, lk=40, m=4, e=2, k_max=2, seed=3)
    n_chunks = 10
    choice[:, :, 0] = n_chunks  # expert 0 for every query
    choice[:, :, 1] = torch.where(torch.arange(40) >= 8, 0, -1)  # chunk 0 once it lies wholly before
    assert_same_as_reference((q, k, v, mk, mv, choice, logp), 4, True)


def test_gathered_logits_far_apart():
    """Scores hundreds apart (keys far below the row maximum are taken at exp(-80), not 0): still equal."""
    q, k, v, mk, mv, choice, logp = random_case(lq=13, lk=13, m=3, seed=5, grad=False)
    q = (q * 300.0).requires_grad_()
    k, mk, logp = k.requires_grad_(), mk.requires_grad_(), (logp * 50.0).requires_grad_()
    assert_same_as_reference((q, k, v, mk, mv, choice, logp), 3, True, tol=1e-4)


def test_gathered_keeps_a_low_precision_dtype():
    """bf16 in, bf16 out, computed in fp32 inside: the reference's fp32 result rounded to bf16."""
    args = random_case(lq=13, lk=13, m=3, seed=7, grad=False)
    low = [a.to(torch.bfloat16).requires_grad_() if a.is_floating_point() else a for a in args]
    out = aamoe_attention(*low, 3, True)
    ref = aamoe_attention_reference(*[a.float() if a.is_floating_point() else a for a in low], 3, True)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2
    grads = torch.autograd.grad(out.float().sum(), [a for a in low if a.requires_grad])
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all() for g in grads)


def test_nothing_to_read_gives_zero_and_no_nan_gradient():
    q, k, v, mk, mv, choice, logp = random_case(lq=6, lk=6, m=3)
    choice[:, :2] = -1  # the first two queries get no resource
    for op in (aamoe_attention_reference, aamoe_attention):
        out = op(q, k, v, mk, mv, choice, logp, 3, False)
        assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
        grads = torch.autograd.grad(out.sum(), (q, k, logp))
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(grads[0][:, :, :2], torch.zeros_like(grads[0][:, :, :2]))
    empty = torch.full((2, 6, 0), -1, dtype=torch.long)
    assert torch.equal(aamoe_attention(q, k, v, mk, mv, empty, logp[..., :0], 3, False), torch.zeros_like(q))


def test_bias_shifts_the_resource_weight():
    """A resource's log P adds to every one of its keys: + log 2 doubles its total weight."""
    q, k, v, mk, mv, choice, logp = random_case(b=1, lq=1, lk=7, m=3, grad=False)
    choice[:] = torch.tensor([0, 3, -1])  # chunk 0 and expert 0 (3 chunks: 0, 1, 2)
    logp = torch.zeros(1, 1, 3)
    a = aamoe_attention(q, k, v, mk, mv, choice, logp, 3, False)
    logp[0, 0, 0] = math.log(2.0)
    b = aamoe_attention(q, k, v, mk, mv, choice, logp, 3, False)
    ref = brute_force(q, k, v, mk, mv, choice, logp, 3, False)
    assert rel_err(b, ref) < 1e-6 and not torch.allclose(a, b)


def test_contract_is_checked():
    q, k, v, mk, mv, choice, logp = random_case(grad=False)
    with pytest.raises(ValueError, match="mem_k"):
        aamoe_attention(q, k, v, mk[:, :, :2], mv, choice, logp, 3, True)
    with pytest.raises(ValueError, match="choice holds resource"):
        aamoe_attention(q, k, v, mk, mv, choice.clamp_min(0) + 10, logp, 3, True)
    with pytest.raises(ValueError, match="logp"):
        aamoe_attention(q, k, v, mk, mv, choice, logp[..., :1], 3, True)
