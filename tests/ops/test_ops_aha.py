"""AHA op: the reference against independent ground truths, the fast path against the reference."""

import pytest
import torch
import torch.nn.functional as F

from allhere.masks import segment_starts
from allhere.ops.aha import aha_attention_fast, aha_attention_reference
from allhere.ops.aha.fast import aha_attention_torch
from allhere.ops.sliding import (
    sliding_window_attention_reference,
    sliding_window_attention_torch,
)
from allhere.ops.ste import straight_through

from helpers import brute_force_aha, rel_err, segment_mask

# (batch, heads, kv_heads, q_len, kv_len, dim, window)
SHAPES = [
    (2, 4, 4, 33, 33, 16, 8),  # prefill, MHA
    (2, 4, 2, 40, 40, 8, 5),  # grouped-query
    (1, 6, 1, 17, 17, 8, 3),  # multi-query
    (2, 4, 2, 1, 30, 8, 7),  # one decode step
    (1, 4, 4, 9, 25, 8, 6),  # chunk continuing a cache
    (2, 2, 2, 20, 20, 8, 1),  # w = 1: each token sees itself only
    (2, 2, 1, 20, 20, 8, 20),  # w = seq
    (1, 2, 2, 12, 12, 8, 100),  # w > seq
]
IDS = [f"b{b}-h{h}-kv{hk}-q{lq}-k{lk}-d{d}-w{w}" for b, h, hk, lq, lk, d, w in SHAPES]


def make(shape, dtype=torch.float32, p_global=0.3):
    b, h, hk, lq, lk, d, w = shape
    q, k, v = (torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, hk, lk, d, dtype=dtype),
               torch.randn(b, hk, lk, d, dtype=dtype))
    return q, k, v, torch.rand(b, h, lq) < p_global, w


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_reference_equals_brute_force_loop(shape):
    q, k, v, gate, w = make(shape)
    assert rel_err(aha_attention_reference(q, k, v, gate, w), brute_force_aha(q, k, v, gate, w)) < 1e-5


def test_gate_all_one_is_causal_sdpa():
    q, k, v, _, w = make((2, 4, 4, 50, 50, 16, 8))
    gate = torch.ones(2, 4, 50, dtype=torch.bool)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(aha_attention_reference(q, k, v, gate, w), ref) < 1e-5
    assert rel_err(aha_attention_fast(q, k, v, gate, w), ref) < 1e-5


def test_gate_all_zero_is_sliding_window():
    q, k, v, _, w = make((2, 4, 2, 50, 50, 16, 8))
    gate = torch.zeros(2, 4, 50)
    ref = brute_force_aha(q, k, v, gate, w)
    assert rel_err(aha_attention_reference(q, k, v, gate, w), ref) < 1e-5
    assert rel_err(sliding_window_attention_reference(q, k, v, w), ref) < 1e-5
    assert rel_err(aha_attention_fast(q, k, v, gate, w), ref) < 1e-5


@pytest.mark.parametrize("block", [1, 3, 8, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_blocked_sliding_equals_reference(shape, block):
    q, k, v, _, w = make(shape)
    out = sliding_window_attention_torch(q, k, v, w, block=block)
    assert rel_err(out, sliding_window_attention_reference(q, k, v, w)) < 1e-5


@pytest.mark.parametrize("p_global", [0.0, 0.07, 0.5, 1.0])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_fast_inference_equals_reference(shape, p_global):
    q, k, v, gate, w = make(shape, p_global=p_global)
    ref = aha_attention_reference(q, k, v, gate, w)
    assert rel_err(aha_attention_fast(q, k, v, gate, w, chunk=4), ref) < 1e-5
    assert rel_err(aha_attention_fast(q, k, v, gate, w, dense_above=0.0), ref) < 1e-5


def test_fast_with_long_tailed_heads_and_float_gate():
    q, k, v, _, w = make((2, 8, 4, 64, 64, 16, 8))
    gate = torch.zeros(2, 8, 64)
    gate[:, 0] = 1.0  # one head always global
    gate[:, 1:] = (torch.rand(2, 7, 64) < 0.05).float()
    assert rel_err(aha_attention_fast(q, k, v, gate, w), brute_force_aha(q, k, v, gate, w)) < 1e-5


@pytest.mark.parametrize("sparse_backward", [True, False], ids=["sparse-backward", "dense-backward"])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=IDS[:5])
def test_fast_gradients_equal_reference(shape, sparse_backward):
    """Both backwards of the PyTorch path (an internal choice: sparse off CUDA, dense on CUDA)."""
    q, k, v, gate, w = make(shape)
    s = torch.rand(gate.shape)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        st = s.clone().requires_grad_()
        out = fn(*leaves, straight_through(st, 0.5), w)
        torch.manual_seed(1)
        (out * torch.randn_like(out)).sum().backward()
        return out, [t.grad for t in leaves] + [st.grad]

    scale = q.shape[-1] ** -0.5
    out_f, g_f = grads(lambda *a: aha_attention_torch(*a, scale, chunk=3, sparse_backward=sparse_backward))
    out_r, g_r = grads(aha_attention_reference)
    assert rel_err(out_f, out_r) < 1e-5
    for name, a, b in zip("qkvs", g_f, g_r):
        assert rel_err(a, b) < 1e-4, name


@pytest.mark.parametrize("layout", ["left-pad", "documents", "documents+pad", "nothing-real"])
@pytest.mark.parametrize("lq", [40, 1, 9], ids=["prefill", "decode", "chunk"])
def test_fast_per_segment_equals_reference_with_the_mask(layout, lq):
    """row_start from segment_starts: every run of one segment alone; values and gradients (q, k, v,
    router scores) equal the reference under the mask; queries that see nothing give zero in both."""
    boundaries, pad = {"left-pad": ([], [0, 5]), "documents": ([13, 31], [0, 0]),
                       "documents+pad": ([13, 33], [0, 7]), "nothing-real": ([], [29, 40])}[layout]
    q, k, v, gate, w = make((2, 4, 2, lq, 40, 8, 5))
    mask = segment_mask(2, lq, 40, boundaries, pad)
    starts = segment_starts(mask, lq, 40)
    assert starts is not None
    s = torch.rand(gate.shape)

    def run(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        st = s.clone().requires_grad_()
        out = fn(*leaves, straight_through(st, 0.5), w, **kw)
        (out * torch.randn_like(out, generator=torch.Generator().manual_seed(1))).sum().backward()
        return [out] + [t.grad for t in leaves] + [st.grad]

    got = run(aha_attention_fast, row_start=starts)
    want = run(aha_attention_reference, mask=mask)
    for name, a, b in zip(["out", "q", "k", "v", "s"], got, want):
        assert rel_err(a, b) < 1e-4, name
    with torch.no_grad():
        assert rel_err(aha_attention_fast(q, k, v, gate, w, row_start=starts),
                       aha_attention_reference(q, k, v, gate, w, mask=mask)) < 1e-5


def test_fast_inference_path_gradients_to_qkv():
    q, k, v, gate, w = make((2, 4, 2, 30, 30, 8, 5))
    outs = []
    for fn in (aha_attention_fast, aha_attention_reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, gate, w).square().sum().backward()
        outs.append([t.grad for t in leaves])
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("fn", [aha_attention_reference, aha_attention_fast], ids=["naive", "fast"])
def test_straight_through_gradient(fn):
    """dL/ds = sum_dim dL/da * (a_full - a_local); the forward value uses the hard gate exactly."""
    q, k, v, _, w = make((2, 4, 2, 24, 24, 8, 4))
    s = torch.rand(2, 4, 24, requires_grad=True)
    hard = s.detach() > 0.5
    gate = straight_through(s, 0.5)
    out = fn(q, k, v, gate, w)
    a_full = fn(q, k, v, torch.ones_like(hard), w)
    a_local = fn(q, k, v, torch.zeros_like(hard), w)
    hard_out = torch.where(hard[..., None], a_full, a_local)
    if fn is aha_attention_reference:  # forward: exactly the hard gate, bit for bit
        assert torch.equal(out, hard_out)
    else:  # the fast path's training kernels may round differently from its inference kernels
        assert rel_err(out, hard_out) < 1e-6
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    expected = (dout * (a_full - a_local)).sum(-1)
    assert rel_err(s.grad, expected) < 1e-5
    assert s.grad.abs().sum() > 0


def test_bf16_fast_matches_fp32_reference():
    q, k, v, gate, w = make((1, 4, 2, 64, 64, 32, 16))
    ref = aha_attention_reference(q, k, v, gate, w)
    out = aha_attention_fast(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, w)
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref) < 2e-2


BAD = {
    "kv-heads": (torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.ones(1, 3, 4), 2, "multiple of kv_heads"),
    "q-longer": (torch.randn(1, 2, 5, 8), torch.randn(1, 2, 4, 8), torch.ones(1, 2, 5), 2, "q_len"),
    "3-D": (torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.ones(2, 4), 2, "4-D"),
    "gate-shape": (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.ones(1, 2, 3), 2, "gate must be"),
    "window-0": (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.ones(1, 2, 4), 0, "window"),
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("fn", [aha_attention_reference, aha_attention_fast], ids=["naive", "fast"])
def test_bad_inputs_raise_clear_errors(fn, case):
    q, k, gate, window, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        fn(q, k, k.clone(), gate, window)
