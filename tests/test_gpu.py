"""The same checks on a CUDA device (skipped without one): bf16 fast path against the fp32 reference."""

import pytest
import torch

from allhere import AHAConfig, Decoder, ModelConfig
from allhere.ops.aha import aha_attention_fast, aha_attention_naive

from helpers import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_fast_bf16_on_cuda_matches_reference(kv_heads):
    q = torch.randn(2, 8, 1000, 64, device="cuda")
    k, v = (torch.randn(2, kv_heads, 1000, 64, device="cuda") for _ in range(2))
    gate = torch.rand(2, 8, 1000, device="cuda") < 0.07
    gate[:, 0] = True
    ref = aha_attention_naive(q, k, v, gate, 64)
    out = aha_attention_fast(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, 64)
    assert rel_err(out.float(), ref) < 2e-2


def test_model_cached_decoding_on_cuda():
    model = Decoder(ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4,
                                mechanism=AHAConfig(window=4, router_init="neutral"))).cuda().eval()
    ids = torch.randint(0, 50, (2, 20), device="cuda")
    cache = model.new_cache()
    steps = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(20)], 1)
    assert rel_err(steps, model(ids).logits) < 1e-4


@pytest.mark.parametrize("lq", [1000, 1])  # whole-sequence prefill, one-token decode
def test_triton_kernels_picked_on_cuda_match_reference(lq):
    pytest.importorskip("triton")
    from allhere.kernels import use_triton

    q = torch.randn(2, 8, lq, 128, device="cuda")
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda") for _ in range(2))
    gate = torch.rand(2, 8, lq, device="cuda") < 0.07
    gate[:, 0] = True
    assert use_triton(q)
    with torch.no_grad():
        out = aha_attention_fast(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, 256)
    assert rel_err(out.float(), aha_attention_naive(q, k, v, gate, 256)) < 2e-2


def test_triton_training_on_cuda_matches_reference_gradients():
    """bf16 training kernels (picked by the op) against the fp32 reference: output and the gradients of
    q, k, v and the router scores (straight-through)."""
    pytest.importorskip("triton")
    from allhere.mechanisms.aha import straight_through

    q = torch.randn(2, 8, 1000, 128, device="cuda")
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda") for _ in range(2))
    scores = torch.rand(2, 8, 1000, device="cuda")
    scores[:, 0] += 0.5  # one busy head
    up = torch.randn_like(q)
    results = []
    for op, dtype in ((aha_attention_fast, torch.bfloat16), (aha_attention_naive, torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [scores.clone().requires_grad_()]
        out = op(*leaves[:3], straight_through(leaves[3], 0.93), 256)
        results.append([out.detach()] + list(torch.autograd.grad((out.float() * up).sum(), leaves)))
    for got, want in zip(*results):
        assert rel_err(got.float(), want.float()) < 2e-2
