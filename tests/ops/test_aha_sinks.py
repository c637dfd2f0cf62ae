"""Sinks in AHA's local branch (``AHAConfig.sinks``): the reference against a brute-force loop, the PyTorch path
and the sliding op against the reference, per segment and with gradients; an all-local AHA model with sinks is
the StreamingLLM pattern (``SinksConfig``) with the same weights."""

import math

import pytest
import torch

from allhere import AHAConfig, Decoder, FullConfig, ModelConfig, SinksConfig, set_forced_gate, swap_mechanism
from allhere.masks import segment_starts
from allhere.ops.aha import aha_attention, aha_attention_reference
from allhere.ops.aha.fast import aha_attention_torch
from allhere.ops.sliding import sliding_window_attention_reference, sliding_window_attention_torch
from allhere.ops.ste import straight_through
from allhere.validation import ConfigError

from helpers import rel_err, segment_mask

# (batch, heads, kv_heads, q_len, kv_len, dim, window, sinks)
SHAPES = [
    (2, 4, 2, 40, 40, 8, 5, 1),  # prefill, grouped-query
    (2, 4, 4, 33, 33, 16, 8, 4),  # MHA, 4 sinks
    (1, 6, 1, 17, 17, 8, 3, 2),  # multi-query
    (2, 4, 2, 1, 30, 8, 7, 3),  # one decode step
    (1, 4, 4, 9, 25, 8, 6, 2),  # a chunk continuing a cache
    (2, 2, 2, 12, 12, 8, 20, 4),  # window past the sequence: sinks change nothing
    (1, 4, 2, 600, 600, 8, 32, 4),  # past the dense cut-off: the blocked path
]
IDS = [f"b{b}-h{h}-kv{hk}-q{lq}-k{lk}-w{w}-s{s}" for b, h, hk, lq, lk, d, w, s in SHAPES]


def make(shape, p_global=0.3):
    b, h, hk, lq, lk, d, w, s = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, lq, d, generator=g), torch.randn(b, hk, lk, d, generator=g),
               torch.randn(b, hk, lk, d, generator=g))
    return q, k, v, torch.rand(b, h, lq, generator=g) < p_global, w, s


def brute_force(q, k, v, gate, window, sinks):
    """Loop over every (batch, head, query): the whole prefix where the gate is set, else the window and the
    first ``sinks`` keys."""
    b, h, lq, d = q.shape
    lk, group = k.shape[2], h // k.shape[1]
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                p = lk - lq + i
                keys = [j for j in range(p + 1) if gate[bi, hi, i] or p - j < window or j < sinks]
                s = k[bi, hi // group, keys].double() @ q[bi, hi, i].double() / math.sqrt(d)
                out[bi, hi, i] = torch.softmax(s, 0) @ v[bi, hi // group, keys].double()
    return out


@pytest.mark.parametrize("shape", SHAPES[:6], ids=IDS[:6])
def test_reference_equals_brute_force(shape):
    q, k, v, gate, w, s = make(shape)
    assert rel_err(aha_attention_reference(q, k, v, gate, w, sinks=s), brute_force(q, k, v, gate, w, s)) < 1e-5


@pytest.mark.parametrize("p_global", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_torch_path_equals_reference(shape, p_global):
    q, k, v, gate, w, s = make(shape, p_global)
    ref = aha_attention(q, k, v, gate, w, sinks=s, backend="reference")
    assert rel_err(aha_attention(q, k, v, gate, w, sinks=s, backend="torch"), ref) < 1e-5
    if p_global < 1.0 and w < shape[4]:  # the sinks are read: without them the result differs
        assert rel_err(aha_attention(q, k, v, gate, w, backend="reference"), ref) > 1e-3


@pytest.mark.parametrize("block", [None, 1, 5, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_blocked_sliding_with_sinks_equals_reference(shape, block):
    q, k, v, _, w, s = make(shape)
    out = sliding_window_attention_torch(q, k, v, w, sinks=s, block=block)
    assert rel_err(out, sliding_window_attention_reference(q, k, v, w, sinks=s)) < 1e-5


@pytest.mark.parametrize("sparse_backward", [True, False], ids=["sparse-backward", "dense-backward"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[-1]], ids=[IDS[0], IDS[1], IDS[-1]])
def test_gradients_equal_reference(shape, sparse_backward):
    """q, k, v and the straight-through gate's scores get the reference's gradients through both backwards."""
    q, k, v, gate, w, s = make(shape)
    scores = torch.rand(gate.shape, generator=torch.Generator().manual_seed(2))

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        st = scores.clone().requires_grad_()
        out = fn(*leaves, straight_through(st, 0.5), w)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        return [out] + [t.grad for t in leaves] + [st.grad]

    scale = q.shape[-1] ** -0.5
    got = grads(lambda *a: aha_attention_torch(*a, scale, chunk=7, sparse_backward=sparse_backward, sinks=s))
    want = grads(lambda *a: aha_attention_reference(*a, sinks=s))
    for name, a, b in zip(["out", "q", "k", "v", "scores"], got, want):
        assert rel_err(a, b) < 1e-4, name


@pytest.mark.parametrize("layout", ["left-pad", "documents", "documents+pad"])
@pytest.mark.parametrize("lq", [40, 1, 9], ids=["prefill", "decode", "chunk"])
def test_sinks_are_each_segments_first_keys(layout, lq):
    """With segment starts a local query reads the first keys of its own segment: each document or padded
    sequence computed alone, both paths."""
    boundaries, pad = {"left-pad": ([], [0, 5]), "documents": ([13, 31], [0, 0]),
                       "documents+pad": ([13, 33], [0, 7])}[layout]
    q, k, v, gate, w, s = make((2, 4, 2, lq, 40, 8, 4, 2))
    mask = segment_mask(2, lq, 40, boundaries, pad)
    starts = segment_starts(mask, lq, 40)
    ref = aha_attention(q, k, v, gate, w, row_start=starts, sinks=s, backend="reference")
    assert rel_err(aha_attention(q, k, v, gate, w, row_start=starts, sinks=s, backend="torch"), ref) < 1e-5
    for i in range(2):  # each query's segment alone: keys from its start, sinks its first keys
        for t in range(lq):
            first = int(starts[i, t])
            if first < 0:
                assert ref[i, :, t].abs().max() == 0
                continue
            end = 40 - lq + t + 1
            alone = aha_attention(q[i:i + 1, :, t:t + 1], k[i:i + 1, :, first:end], v[i:i + 1, :, first:end],
                                  gate[i:i + 1, :, t:t + 1], w, sinks=s, backend="reference")
            assert rel_err(ref[i:i + 1, :, t:t + 1], alone) < 1e-5


def test_all_local_aha_with_sinks_is_the_streaming_pattern():
    """Every gate local, AHA with sinks computes what StreamingLLM's pattern (``SinksConfig``) computes with the
    same weights, on the full forward and token by token on its cache; without sinks it does not."""
    base = Decoder(ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               mechanism=FullConfig())).eval()
    ids = torch.randint(0, 61, (2, 30))
    aha = swap_mechanism(base, AHAConfig(window=6, sinks=3)).eval()
    streaming = swap_mechanism(base, SinksConfig(window=6, n_sinks=3)).eval()
    set_forced_gate(aha, False)
    with torch.no_grad():
        want = streaming(ids).logits
        assert rel_err(aha(ids).logits, want) < 1e-5
        cache = aha.new_cache()
        steps = torch.cat([aha(ids[:, t:t + 1], cache=cache).logits for t in range(30)], 1)
        assert rel_err(steps, want) < 1e-5
        plain = swap_mechanism(base, AHAConfig(window=6)).eval()
        set_forced_gate(plain, False)
        assert rel_err(plain(ids).logits, want) > 1e-3


@pytest.mark.parametrize("kw, field", [({"window": 4, "sinks": 4}, "sinks"), ({"sinks": -1}, "sinks"),
                                       ({"sinks": 1.5}, "sinks"), ({"sinks": True}, "sinks")])
def test_bad_sinks_are_refused_naming_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"AHAConfig.{field} = "):
        AHAConfig(**kw)


def test_the_op_refuses_bad_sinks():
    q, k, v, gate, w, _ = make(SHAPES[0])
    with pytest.raises(ValueError, match="sinks must be an integer >= 0"):
        aha_attention(q, k, v, gate, w, sinks=-2)
