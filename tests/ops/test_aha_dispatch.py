"""aha_attention's routing by backend, the Triton backend's refusals, and the gate contract (no re-threshold)."""

import pytest
import torch

from allhere.backend import use_backend
from allhere.masks import segment_starts
from allhere.ops.aha import aha_attention, aha_attention_fast, aha_attention_reference
from allhere.ops.ste import straight_through

from helpers import brute_force_aha, rel_err, segment_mask, spy_paths


def qkv(b=2, h=4, hkv=2, lq=24, lk=24, d=16):
    return torch.randn(b, h, lq, d), torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)


def backends():
    """The backends that run on this machine's CPU tensors: "triton" only under Triton's interpreter."""
    names = ["reference", "torch", "auto"]
    try:
        from allhere import kernels

        if kernels.triton_available() and (torch.cuda.is_available() or kernels.interpreted()):
            names.append("triton")
    except ImportError:
        pass
    return names


@pytest.mark.parametrize("backend", backends())
def test_tau_07_gate_is_the_hard_gate_and_its_gradient_reaches_the_scores(backend):
    """A gate from tau = 0.7: scores in (0.5, 0.7] are local. Output and dL/ds equal the reference built
    from the hard gate 1[s > 0.7] and a brute-force loop (dL/ds = sum dL/da (a_full - a_local), Eq. 3)."""
    q, k, v = qkv()
    w = 5
    s = torch.rand(2, 4, 24)
    s[:, :, ::3] = 0.5 + 0.2 * torch.rand(2, 4, 8)  # a third of the scores in (0.5, 0.7]
    s[0, 0, 1] = 0.7  # exactly tau: local
    middle = (s > 0.5) & (s <= 0.7)
    hard = s > 0.7
    up = torch.randn(2, 4, 24, 16)

    def run(gate_of, fn):
        leaf = s.clone().requires_grad_()
        out = fn(gate_of(leaf))
        out.backward(up)
        return out.detach(), leaf.grad

    device = "cuda" if torch.cuda.is_available() and backend == "triton" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    got, got_grad = run(lambda t: straight_through(t.to(device), 0.7),
                        lambda g: aha_attention(*(x.to(device, dtype) for x in (q, k, v)), g, w, backend=backend)
                        .float().cpu())
    want, want_grad = run(lambda t: hard.float() + (t - t.detach()), lambda g: aha_attention_reference(q, k, v, g, w))
    a_full, a_local = (brute_force_aha(q, k, v, torch.full_like(hard, on), w) for on in (True, False))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(got, want) < tol and rel_err(got, brute_force_aha(q, k, v, hard, w)) < tol
    assert rel_err(got[middle], a_local[middle]) < tol  # the (0.5, 0.7] scores went local
    assert rel_err(got_grad, want_grad) < 5 * tol
    assert rel_err(got_grad, (up.double() * (a_full - a_local)).sum(-1)) < 5 * tol


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_a_gate_of_scores_is_refused_not_rethresholded(backend):
    q, k, v = qkv()
    s = torch.rand(2, 4, 24)
    with pytest.raises(ValueError, match="only 0 and 1"):
        aha_attention(q, k, v, s, 5, backend=backend)
    with pytest.raises(ValueError, match="bool or a 0/1-valued float"):
        aha_attention(q, k, v, (s > 0.5).long(), 5, backend=backend)
    manual = (s > 0.5).float() + s - s.detach()  # not exactly 0 / 1 in floating point: refused too
    if not bool(((manual == 0) | (manual == 1)).all()):
        with pytest.raises(ValueError, match="only 0 and 1"):
            aha_attention(q, k, v, manual, 5, backend=backend)


def test_backends_route_and_agree(monkeypatch):
    q, k, v = qkv(lq=9, lk=24)
    gate = torch.rand(2, 4, 9) < 0.3
    mask = segment_mask(2, 9, 24, [17], [0, 4])
    starts = segment_starts(mask, 9, 24)
    want = aha_attention_reference(q, k, v, gate, 5, mask=mask)
    calls = spy_paths(monkeypatch)
    ref, torch_path = ("aha", "reference"), ("aha", "torch")
    assert rel_err(aha_attention(q, k, v, gate, 5, row_start=starts, backend="reference"), want) < 1e-6
    assert calls == [ref]
    with use_backend("reference"):
        assert rel_err(aha_attention(q, k, v, gate, 5, row_start=starts), want) < 1e-6
        assert calls == [ref] * 2
        assert rel_err(aha_attention_fast(q, k, v, gate, 5, row_start=starts), want) < 1e-5  # never the reference
        assert calls == [ref] * 2 + [torch_path]
        assert rel_err(aha_attention(q, k, v, gate, 5, row_start=starts, backend="torch"), want) < 1e-5
    assert calls.count(torch_path) == 2
    assert rel_err(aha_attention(q, k, v, gate, 5, row_start=starts), want) < 1e-5  # auto on the CPU: PyTorch
    assert calls.count(torch_path) == 3 and calls.count(ref) == 2
    with pytest.raises(ValueError, match="backend must be one of"):
        aha_attention(q, k, v, gate, 5, backend="flash")
    with pytest.raises(ValueError, match="row_start must be"):
        aha_attention(q, k, v, gate, 5, row_start=starts[:, :3])


def test_triton_backend_says_why_it_cannot_take_a_call(monkeypatch):
    pytest.importorskip("triton")
    from allhere import kernels

    gate = torch.zeros(2, 4, 24, dtype=torch.bool)

    def refused(match, q, k, v, g=gate):
        with pytest.raises(ValueError, match=f"backend 'triton' cannot take this aha call: .*{match}"):
            aha_attention(q, k, v, g, 5, backend="triton")

    refused("head dim 8", *qkv(d=8))
    refused("dtype torch.float64", *(t.double() for t in qkv()))
    refused("q_len=9 with kv_len=24", *qkv(lq=9), g=gate[:, :, :9])
    q, k, v = qkv(lq=1)
    refused("decode step .* gradients", q.requires_grad_(), k, v, g=gate[:, :, :1])
    if not torch.cuda.is_available():
        monkeypatch.setattr(kernels, "interpreted", lambda: False)
        refused("not CUDA", *qkv())
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    refused("triton is not installed", *qkv())
    assert aha_attention(*qkv(d=8), gate, 5).shape == (2, 4, 24, 8)  # auto falls back to PyTorch
