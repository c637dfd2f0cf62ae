"""The Triton decode kernel of op family ``dar_latent`` (``allhere.kernels.dar_latent_decode``) against the dense
fp32 reference, by relative error (< 1e-5 in float32, < 2e-2 in bfloat16): compiled on a GPU, in Triton's
interpreter on the CPU (small shapes: the interpreter is slow). Splits of 16 keys, so most cases merge several."""

import pytest
import torch

pytest.importorskip("triton")  # on the CPU, conftest.py has chosen Triton's interpreter

from allhere import kernels, use_backend  # noqa: E402
from allhere.kernels.dar_latent_decode import dar_latent_decode_triton  # noqa: E402
from allhere.ops.dar_latent import dar_latent_attention, dar_latent_attention_reference  # noqa: E402
from allhere.ops.dar_latent.check import pack_rows  # noqa: E402

from helpers import rel_err, segment_mask, spy_paths  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SMALL = dict(split=16, block_n=16)  # several splits per head, several steps per split


def inputs(b=2, h=4, g=2, lq=1, lk=23, d=16, e_r=4, d_c=12, near=None, seed=0):
    """fp32 CPU inputs (as ``test_ops_dar_latent``); near: k_near / v_near of the last ``near`` positions only."""
    torch.manual_seed(seed)
    t = torch.randn
    x = dict(q=t(b, h, lq, d), q_far=t(b, h, lq, d), k_near=t(b, g, lk, d), v_near=t(b, g, lk, d),
             rows=pack_rows(t(b, lk, d_c), t(b, g, lk, e_r)), w_uk=t(g, d - e_r, d_c) / d_c ** 0.5,
             w_uv=t(g, d, d_c) / d_c ** 0.5)
    if near is not None:
        x["k_near"], x["v_near"] = x["k_near"][:, :, lk - near:], x["v_near"][:, :, lk - near:]
    return x


def on_device(x, dtype):
    return {k: v.to(DEVICE, dtype if k != "w_uk" and k != "w_uv" else torch.float32) for k, v in x.items()}


def check(x, window, dtype=torch.float32, mask=None, scale=None, **kernel_args):
    want = dar_latent_attention_reference(**x, window=window, scale=scale, mask=mask)
    m = None if mask is None else mask.to(DEVICE)
    got = dar_latent_decode_triton(**on_device(x, dtype), window=window, scale=scale, mask=m, **kernel_args)
    assert got.dtype == dtype and got.shape == want.shape
    assert rel_err(got.float().cpu(), want) < TOL[dtype]
    return got


@pytest.mark.parametrize("window", [0, 1, 5, 40], ids=lambda w: f"w{w}")  # 40 > lk: every key near
@pytest.mark.parametrize("lq", [1, 2], ids=lambda n: f"q{n}")
def test_decode_equals_the_reference(lq, window):
    check(inputs(lq=lq), window, **SMALL)


@pytest.mark.parametrize("lq,window", [(1, 1), (2, 5), (2, 40)])
def test_near_keys_of_the_window_only(lq, window):
    """k_near / v_near covering only the last lq + window - 1 positions (what a cache keeps), read at their
    shift; with window 40 > lk they cover every position."""
    check(inputs(lq=lq, near=min(23, lq + window - 1)), window, **SMALL)


@pytest.mark.parametrize("h,g,e_r,d_c,d", [
    (4, 4, 0, 12, 16),    # MHA, no rotated part
    (4, 2, 4, 144, 64),   # GQA, d_c past a power of two
    (4, 1, 8, 12, 64),    # MQA
    (6, 2, 8, 144, 16),   # a group of 3 heads: 6 rows, padded to 16
], ids=["mha", "gqa", "mqa", "group3"])
def test_heads_and_dimensions(h, g, e_r, d_c, d):
    check(inputs(h=h, g=g, lq=2, e_r=e_r, d_c=d_c, d=d, near=6), 5, **SMALL)


def test_sixteen_queries_in_row_blocks():
    """q_len 16 (the most the op routes here) with a group of 2: 32 rows in two programs of 16."""
    check(inputs(lq=16, lk=40, near=21), 6, block_m=16, **SMALL)


@pytest.mark.parametrize("lq,window,e_r,d_c", [(1, 5, 4, 12), (2, 0, 8, 144), (2, 40, 0, 12)])
def test_bfloat16(lq, window, e_r, d_c):
    check(inputs(lq=lq, e_r=e_r, d_c=d_c), window, dtype=torch.bfloat16, **SMALL)


def test_mask_and_a_scale():
    """A caller's mask (padding on both sides, two documents): padding queries see nothing and give 0."""
    mask = segment_mask(2, 3, 23, [12], pad_left=[3, 0], pad_right=[1, 0])
    got = check(inputs(lq=3), 4, mask=mask, scale=0.3, **SMALL)
    assert torch.all(got[0, :, -1] == 0)  # batch row 0's last query is right padding


def test_one_split_and_the_default_launch():
    check(inputs(lq=2, lk=40), 5)


def test_backend_triton_runs_the_kernel_and_auto_only_on_cuda(monkeypatch):
    calls = spy_paths(monkeypatch)
    x = inputs(lq=2)
    want = dar_latent_attention_reference(**x, window=5)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    for name in ("triton", "auto"):
        with use_backend(name):
            assert rel_err(dar_latent_attention(**on_device(x, dtype), window=5).float().cpu(), want) < TOL[dtype]
    assert calls == [("dar_latent", "triton"), ("dar_latent", "triton" if DEVICE == "cuda" else "torch")]


def test_refusals_name_the_reason(monkeypatch):
    x = inputs(lq=17, lk=30)
    with pytest.raises(ValueError, match="q_len=17"):
        dar_latent_attention(**x, window=5, backend="triton")
    x = inputs(lq=1)
    with pytest.raises(ValueError, match="no backward"):
        dar_latent_attention(**{**x, "q": x["q"].clone().requires_grad_()}, window=5, backend="triton")
    with pytest.raises(ValueError, match="one for all five"):
        dar_latent_attention(**{**x, "rows": x["rows"].double()}, window=5, backend="triton")
    if DEVICE == "cpu":
        monkeypatch.setattr(kernels, "interpreted", lambda: False)
        with pytest.raises(ValueError, match="not CUDA"):
            dar_latent_attention(**x, window=5, backend="triton")
