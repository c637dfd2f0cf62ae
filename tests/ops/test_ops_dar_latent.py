"""Op family ``dar_latent`` (DAR with distant keys scored in the latent): the absorbed path (decoding) and the
rebuilt path (prefill, training) and the fused one (inference prefill on the CPU) against the dense fp32 reference,
outputs and gradients, by relative error:
< 1e-5 in float32, < 2e-2 in bfloat16 (the paths compute in the inputs' dtype, the reference in fp32)."""

import pytest
import torch

from allhere import use_backend
from allhere.ops.dar_latent import (
    dar_latent_attention,
    dar_latent_attention_absorbed,
    dar_latent_attention_fused,
    dar_latent_attention_rebuilt,
    dar_latent_attention_reference,
)
from allhere.ops.dar_latent.check import pack_rows, split_rows
from allhere.ops.dar_latent.reference import far_kv

from helpers import rel_err, segment_mask

PATHS = {"absorbed": dar_latent_attention_absorbed, "rebuilt": dar_latent_attention_rebuilt}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def inputs(b=2, h=4, g=2, lq=9, lk=23, d=16, e_r=4, d_c=12, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    t = lambda *s: torch.randn(*s).to(dtype)  # noqa: E731
    return dict(q=t(b, h, lq, d), q_far=t(b, h, lq, d), k_near=t(b, g, lk, d), v_near=t(b, g, lk, d),
                rows=pack_rows(t(b, lk, d_c), t(b, g, lk, e_r)), w_uk=t(g, d - e_r, d_c) / d_c ** 0.5,
                w_uv=t(g, d, d_c) / d_c ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 1, 5, 40], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("lq", [1, 3, 23], ids=lambda n: f"q{n}")
@pytest.mark.parametrize("path", PATHS)
def test_paths_equal_the_reference(path, lq, window, dtype):
    x = inputs(lq=lq, dtype=dtype)
    want = dar_latent_attention_reference(**x, window=window)
    got = PATHS[path](**x, window=window, block=4)  # blocks that cut the window
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("lq", [1, 3], ids=lambda n: f"q{n}")
@pytest.mark.parametrize("path", [*PATHS, "reference"])
def test_near_keys_of_the_window_only(path, lq):
    """A cache keeps the host's K/V for the window only: k_near / v_near covering the last lq + w - 1 positions
    give what the full-length ones give; fewer are refused."""
    x = inputs(lq=lq)
    want = dar_latent_attention_reference(**x, window=5)
    fn = PATHS.get(path, dar_latent_attention_reference)
    short = {**x, "k_near": x["k_near"][:, :, -(lq + 4):], "v_near": x["v_near"][:, :, -(lq + 4):]}
    assert rel_err(fn(**short, window=5), want) < 1e-6
    with pytest.raises(ValueError, match="must cover the last"):
        fn(**{**short, "k_near": short["k_near"][:, :, 1:], "v_near": short["v_near"][:, :, 1:]}, window=5)


@pytest.mark.parametrize("g", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("path", PATHS)
def test_grouped_heads_padding_and_a_scale(path, g):
    x = inputs(g=g, lq=23)
    mask = segment_mask(2, 23, 23, [9], pad_left=[3, 0], pad_right=[0, 4])
    want = dar_latent_attention_reference(**x, window=4, scale=0.3, mask=mask)
    got = PATHS[path](**x, window=4, scale=0.3, mask=mask)
    assert rel_err(got, want) < 1e-5
    assert torch.all(got[0, :, :3] == 0)  # padding queries see nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("g", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [0, 1, 5, 40], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("lq", [1, 3, 23], ids=lambda n: f"q{n}")
def test_fused_equals_the_reference(lq, window, g, dtype):
    """The fused path over key lengths from lq (no key before the queries) to past the window, with full-length
    near keys and with those of the windows only, and near blocks that cut the window or hold every query."""
    for lk in sorted({lq, 23, 30}):
        x = inputs(g=g, lq=lq, lk=lk, dtype=dtype)
        want = dar_latent_attention_reference(**x, window=window)
        n = min(lk, lq + max(window, 1) - 1)  # the fewest the check takes
        short = {**x, "k_near": x["k_near"][:, :, lk - n:], "v_near": x["v_near"][:, :, lk - n:]}
        for y in (x, short):
            for block in (4, 64):
                got = dar_latent_attention_fused(**y, window=window, block=block)
                assert got.dtype == dtype
                assert rel_err(got, want) < TOL[dtype], (lk, y["k_near"].shape[2], block)


@pytest.mark.parametrize("e_c", [6, 20])
def test_fused_far_keys_of_another_size(e_c):
    """Far queries / keys narrower or wider than the values (d = 16): the fused kernel takes one head size."""
    x = inputs(lq=23, lk=30)
    x["q_far"] = torch.randn(2, 4, 23, 4 + e_c)
    x["w_uk"] = torch.randn(2, e_c, 12) / 12 ** 0.5
    want = dar_latent_attention_reference(**x, window=5, scale=0.3)
    assert rel_err(dar_latent_attention_fused(**x, window=5, scale=0.3), want) < 1e-5


def test_the_torch_path_fuses_only_unmasked_inference(monkeypatch):
    """dar_latent_attention routes a long unmasked call without gradients to the fused path; with gradients or a
    mask to the rebuilt one (the fused path refuses masks and has no backward)."""
    from allhere.ops.dar_latent import dispatch

    calls = []
    monkeypatch.setattr(dispatch, "dar_latent_attention_fused",
                        lambda *a, **k: calls.append(1) or dar_latent_attention_fused(*a, **k))
    x = inputs(lq=23)
    want = dar_latent_attention_reference(**x, window=5)
    with use_backend("torch"):
        with torch.no_grad():
            assert rel_err(dar_latent_attention(**x, window=5), want) < 1e-5 and calls == [1]
        assert rel_err(dar_latent_attention(**x, window=5), want) < 1e-5 and calls == [1, 1]  # nothing needs grad
        x["q"].requires_grad_()
        assert dar_latent_attention(**x, window=5).grad_fn is not None and calls == [1, 1]
        with torch.no_grad():
            dar_latent_attention(**x, window=5, mask=torch.ones(1, 1, 23, 23, dtype=torch.bool))
    assert calls == [1, 1]
    with pytest.raises(ValueError, match="no mask"):
        dar_latent_attention_fused(**x, window=5, mask=torch.ones(1, 1, 23, 23, dtype=torch.bool))


def test_reference_is_dar_with_the_far_keys_written_out():
    """The reference equals DAR's own reference given the far keys / values the latent stands for, when the far
    query is the near one (an oracle written independently of the latent form)."""
    from allhere.ops.dar import dar_attention_reference

    x = inputs()
    x["q_far"] = x["q"]
    k_far, v_far = far_kv(*split_rows(x["rows"], 2, 12), x["w_uk"], x["w_uv"])
    want = dar_attention_reference(x["q"], x["k_near"], x["v_near"], k_far, v_far, 5)
    assert rel_err(dar_latent_attention_reference(**x, window=5), want) < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_gradients_equal_the_reference(path):
    x = {k: v.requires_grad_() for k, v in inputs(lq=23).items()}
    weights = torch.randn(2, 4, 23, 16)
    grads = []
    for fn in (dar_latent_attention_reference, PATHS[path]):
        out = fn(**x, window=5)
        grads.append(torch.autograd.grad((out * weights).sum(), list(x.values())))
    for name, a, b in zip(x, *grads):
        assert rel_err(b, a) < 1e-5, name


def test_backends_pick_their_path():
    x = inputs(lq=1)
    want = dar_latent_attention_reference(**x, window=5)
    for name in ("reference", "torch", "auto"):
        with use_backend(name):
            assert rel_err(dar_latent_attention(**x, window=5), want) < 1e-5, name


def test_bad_shapes_are_named():
    x = inputs()
    x["w_uv"] = x["w_uv"][:, :3]
    with pytest.raises(ValueError, match="w_uv must be"):
        dar_latent_attention_reference(**x, window=5)


@pytest.mark.parametrize("rot", [16, 10])
def test_absorbed_queries_in_one_matmul_equal_far_queries_then_query_rows(rot):
    """The served decode's query rows (``query_map``: the rotation undone, the channels reordered, W_UK and the
    slots folded into one matrix per KV head) = ``far_queries`` then ``query_rows``, with a full and a partial
    rotary width, the kept pairs chosen per KV head."""
    from allhere.mechanisms.dar_latent_channels import channel_order, far_queries
    from allhere.ops.dar_latent.check import query_rows
    from allhere.ops.dar_latent.query_map import absorbed_queries, query_map, rotary_factors

    gen = torch.Generator().manual_seed(3)
    n, heads, g, d, pairs, d_c = 5, 6, 3, 16, 2, 7
    kept = torch.stack([torch.randperm(rot // 2, generator=gen)[:pairs] for _ in range(g)])
    channels = channel_order(kept, rot, d)
    q = torch.randn(n, heads, d, generator=gen)
    angles = torch.rand(n, rot // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    w_uk = torch.randn(g, d - 2 * pairs, d_c, generator=gen)
    want = query_rows(far_queries(q.transpose(0, 1)[None], torch.cat([cos, cos], -1), torch.cat([sin, sin], -1),
                                  channels, 2 * pairs)[0].transpose(0, 1).reshape(n, g, heads // g, d), w_uk,
                      2 * pairs, torch.float32).reshape(n, heads, -1)
    got = absorbed_queries(q, rotary_factors(cos, sin, d), query_map(channels, w_uk, 2 * pairs), torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
