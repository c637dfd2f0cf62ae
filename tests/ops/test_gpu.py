"""The same checks on a CUDA device (skipped without one): the bf16 backends ("auto", "torch", "triton")
against the fp32 reference."""

import pytest
import torch

from allhere import AHAConfig, Decoder, ModelConfig
from allhere.ops.aha import aha_attention, aha_attention_fast, aha_attention_reference
from allhere.ops.ste import straight_through

from helpers import rel_err, spy_paths

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_fast_bf16_on_cuda_matches_reference(kv_heads, backend):
    q = torch.randn(2, 8, 1000, 64, device="cuda")
    k, v = (torch.randn(2, kv_heads, 1000, 64, device="cuda") for _ in range(2))
    gate = torch.rand(2, 8, 1000, device="cuda") < 0.07
    gate[:, 0] = True
    ref = aha_attention_reference(q, k, v, gate, 64)
    out = aha_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, 64, backend=backend)
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
    from allhere.ops.aha.triton_path import triton_refusal

    q = torch.randn(2, 8, lq, 128, device="cuda")
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda") for _ in range(2))
    gate = torch.rand(2, 8, lq, device="cuda") < 0.07
    gate[:, 0] = True
    bf16 = [t.bfloat16() for t in (q, k, v)]
    assert triton_refusal(*bf16, gate) is None
    assert "float32" in triton_refusal(q, k, v, gate)  # fp32 stays on the PyTorch path (tf32 dots)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        calls = spy_paths(mp)
        out = aha_attention_fast(*bf16, gate, 256)
        assert rel_err(aha_attention(*bf16, gate, 256, backend="triton").float(), out.float()) < 1e-6
    assert calls == [("aha", "triton")] * 2
    assert rel_err(out.float(), aha_attention_reference(q, k, v, gate, 256)) < 2e-2
    with pytest.raises(ValueError, match="float32"):
        aha_attention(q, k, v, gate, 256, backend="triton")


def test_triton_training_on_cuda_matches_reference_gradients():
    """bf16 training kernels (picked by the op) against the fp32 reference: output and the gradients of
    q, k, v and the router scores (straight-through)."""
    pytest.importorskip("triton")
    q = torch.randn(2, 8, 1000, 128, device="cuda")
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda") for _ in range(2))
    scores = torch.rand(2, 8, 1000, device="cuda")
    scores[:, 0] += 0.5  # one busy head
    up = torch.randn_like(q)
    results = []
    for backend, dtype in (("triton", torch.bfloat16), ("torch", torch.bfloat16), ("reference", torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [scores.clone().requires_grad_()]
        out = aha_attention(*leaves[:3], straight_through(leaves[3], 0.93), 256, backend=backend)
        results.append([out.detach()] + list(torch.autograd.grad((out.float() * up).sum(), leaves)))
    for kernels, torch_path, want in zip(*results):
        assert rel_err(kernels.float(), want.float()) < 2e-2 and rel_err(torch_path.float(), want.float()) < 2e-2
