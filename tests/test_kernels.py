"""Triton kernels against the dense reference: compiled on a GPU, in Triton's interpreter on the CPU."""

import pytest
import torch

pytest.importorskip("triton")  # on the CPU, conftest.py has chosen Triton's interpreter

from allhere.kernels.aha_decode import aha_decode_triton  # noqa: E402
from allhere.kernels.aha_prefill import aha_prefill_triton, pack_global  # noqa: E402
from allhere.ops.aha import aha_attention_naive  # noqa: E402

from helpers import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, TOL = (torch.bfloat16, 2e-2) if DEVICE == "cuda" else (torch.float32, 1e-5)


def inputs(b, h, hkv, lq, lk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k, v = (torch.randn(b, hkv, lk, d, generator=g) for _ in range(2))
    return q, k, v


def run(fn, q, k, v, *args, **kw):
    return fn(*(t.to(DEVICE, DTYPE) for t in (q, k, v)), *args, **kw).float().cpu()


@pytest.mark.parametrize("b,h,hkv,n,d,w", [(2, 4, 2, 50, 16, 7), (1, 2, 1, 33, 32, 40), (1, 4, 4, 70, 16, 1)])
@pytest.mark.parametrize("pattern", ["mixed", "all-local", "all-global"])
def test_prefill_equals_reference(b, h, hkv, n, d, w, pattern):
    q, k, v = inputs(b, h, hkv, n, n, d)
    gate = {"mixed": torch.rand(b, h, n, generator=torch.Generator().manual_seed(1)) < 0.3,
            "all-local": torch.zeros(b, h, n, dtype=torch.bool), "all-global": torch.ones(b, h, n, dtype=torch.bool)}[pattern]
    if pattern == "mixed":
        gate[:, 0] = True  # a busy head next to rare ones: packed per head, each with its own count
    out = run(aha_prefill_triton, q, k, v, gate.to(DEVICE), w, d ** -0.5, block_m=16, block_n=16)
    assert rel_err(out, aha_attention_naive(q, k, v, gate, w)) < TOL


def test_packing_has_one_block_per_started_block_m_of_each_head():
    gate = torch.zeros(1, 3, 40, dtype=torch.bool)
    gate[0, 0, :35] = True  # 35 pairs: blocks of 16, 16, 3
    gate[0, 2, [5, 9]] = True  # 2 pairs: one block of 2; head 1 has none
    rows, bh, start, count = pack_global(gate, 16)
    assert bh.tolist() == [0, 0, 0, 2] and start.tolist() == [0, 16, 32, 35] and count.tolist() == [16, 16, 3, 2]
    assert rows[35:].tolist() == [5, 9]


@pytest.mark.parametrize("b,h,hkv,t,d,w,split", [(2, 4, 2, 150, 16, 7, 32), (1, 2, 1, 33, 32, 40, 64),
                                                  (3, 4, 4, 100, 16, 1, 16)])
def test_decode_equals_reference(b, h, hkv, t, d, w, split):
    q, k, v = inputs(b, h, hkv, 1, t, d)
    gate = torch.rand(b, h, 1, generator=torch.Generator().manual_seed(2)) < 0.5
    gate[0, 0], gate[-1, -1] = True, False
    out = run(aha_decode_triton, q, k, v, gate[..., 0].to(DEVICE), w, d ** -0.5, split=split, block_n=16)
    assert rel_err(out, aha_attention_naive(q, k, v, gate, w)) < TOL
