"""The Triton kernels with sinks in AHA's local branch (``sinks`` = s: a local query also reads the first s keys of
its segment) against the dense reference: prefill, training (gradients of q, k, v and the straight-through gate),
decode and the paged kernel; compiled on a GPU, in Triton's interpreter on the CPU (small sizes)."""

import pytest
import torch

pytest.importorskip("triton")  # on the CPU, conftest.py has chosen Triton's interpreter

from test_aha_paged import MIXED, SMALL, Step  # noqa: E402

from allhere.kernels import autotune  # noqa: E402
from allhere.kernels.aha_decode import aha_decode_triton  # noqa: E402
from allhere.kernels.aha_prefill import aha_prefill_triton  # noqa: E402
from allhere.kernels.aha_train import aha_train_triton  # noqa: E402
from allhere.masks import segment_starts  # noqa: E402
from allhere.ops.aha import aha_attention, aha_attention_reference  # noqa: E402
from allhere.ops.ste import straight_through  # noqa: E402

from helpers import rel_err, segment_mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, TOL = (torch.bfloat16, 2e-2) if DEVICE == "cuda" else (torch.float32, 1e-5)  # the interpreter takes fp32
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
T16 = dict(BLOCK_M=16, BLOCK_N=16)  # several query tiles and key blocks per sequence
SMALL_TILES = {name: T16 for name in ("sliding", "global", "local_dq", "global_dq", "dkdv")}

# (document boundaries, left padding per sequence): padding queries see nothing (row_start -1)
LAYOUTS = {"none": None, "left-pad": ([], [0, 9]), "documents": ([21, 40], [0, 0]), "documents+pad": ([21, 40], [0, 7])}
# (sinks, window, layout, length): s = 17 fills a key block of 16 and starts the next (two sink blocks)
CASES = [(1, 5, "none", 50), (4, 7, "left-pad", 50), (4, 6, "documents+pad", 50), (17, 20, "left-pad", 70)]
IDS = [f"s{s}-w{w}-{layout}" for s, w, layout, _ in CASES]


def inputs(b, h, hkv, lq, lk, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, lq, d, generator=g), *(torch.randn(b, hkv, lk, d, generator=g) for _ in range(2))


def starts_of(layout, b, n):
    return None if LAYOUTS[layout] is None else segment_starts(segment_mask(b, n, n, *LAYOUTS[layout]), n, n)


def dev(t, dtype=DTYPE):
    return None if t is None else t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)


@pytest.mark.parametrize("sinks,w,layout,n", CASES, ids=IDS)
def test_prefill_with_sinks_equals_the_reference(sinks, w, layout, n):
    """GQA, mixed gates, several query tiles and key blocks; segments (each one's own sinks), padding rows that
    see nothing (zero)."""
    q, k, v = inputs(2, 4, 2, n, n)
    gate = torch.rand(2, 4, n, generator=torch.Generator().manual_seed(1)) < 0.3
    starts = starts_of(layout, 2, n)
    out = aha_prefill_triton(dev(q), dev(k), dev(v), dev(gate), w, 0.25, tiles=T16, row_start=dev(starts),
                             sinks=sinks).float().cpu()
    want = aha_attention(q, k, v, gate, w, 0.25, row_start=starts, backend="reference", sinks=sinks)
    assert rel_err(out, want) < TOL
    assert rel_err(want, aha_attention(q, k, v, gate, w, 0.25, row_start=starts, backend="reference")) > 1e-2


def test_tensor_descriptor_path_with_sinks():
    """The sink passes through tensor descriptors (TMA on Hopper; Triton's interpreter runs them on the CPU):
    prefill and training, with segments."""
    q, k, v = inputs(2, 2, 1, 50, 50)
    gate = torch.rand(2, 2, 50, generator=torch.Generator().manual_seed(10)) < 0.3
    starts = starts_of("documents+pad", 2, 50)
    tma = dict(BLOCK_M=16, BLOCK_N=16, TMA=True)
    out = aha_prefill_triton(dev(q), dev(k), dev(v), dev(gate), 6, 0.25, tiles=tma, row_start=dev(starts), sinks=4)
    want = aha_attention_reference(q, k, v, gate, 6, 0.25, row_start=starts, sinks=4)
    assert rel_err(out.float().cpu(), want) < TOL
    leaves = [dev(t).requires_grad_() for t in (q, k, v)]
    out, _ = aha_train_triton(*leaves, dev(gate), 6, 0.25, tiles=tma, row_start=dev(starts), sinks=4)
    got = torch.autograd.grad(out.float().square().sum(), leaves)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(aha_attention_reference(*ref, gate, 6, 0.25, row_start=starts, sinks=4).square().sum(),
                               ref)
    for name, a, r in zip("qkv", got, want):
        assert rel_err(a.float().cpu(), r) < TOL, name


def test_prefill_with_sinks_in_half_precision():
    q, k, v = inputs(1, 4, 1, 40, 40)
    gate = torch.rand(1, 4, 40, generator=torch.Generator().manual_seed(2)) < 0.2
    out = aha_prefill_triton(dev(q, HALF), dev(k, HALF), dev(v, HALF), dev(gate), 6, 0.25, tiles=T16, sinks=3)
    assert rel_err(out.float().cpu(), aha_attention_reference(q, k, v, gate, 6, 0.25, sinks=3)) < 2e-2


@pytest.mark.parametrize("sinks,w,layout,n", CASES[:1] + CASES[2:], ids=IDS[:1] + IDS[2:])
def test_training_with_sinks_gives_the_reference_gradients(sinks, w, layout, n):
    """The op on the training kernels (small tiles) with a straight-through gate: the output and the gradients
    of q, k, v and the router scores (a_local with its sinks) equal the reference's."""
    q, k, v = inputs(2, 2, 1, n, n, seed=3)
    scores = torch.rand(2, 2, n, generator=torch.Generator().manual_seed(4))
    up = torch.randn(2, 2, n, 16, generator=torch.Generator().manual_seed(5))
    starts = starts_of(layout, 2, n)
    results = []
    for backend, dtype in (("triton", DTYPE), ("reference", torch.float32)):
        leaves = [dev(t, dtype).requires_grad_() for t in (q, k, v)] + [dev(scores, torch.float32).requires_grad_()]
        with autotune.pinned(SMALL_TILES):
            out = aha_attention(*leaves[:3], straight_through(leaves[3], 0.7), w, row_start=dev(starts),
                                backend=backend, sinks=sinks)
            grads = torch.autograd.grad((out.float() * dev(up, torch.float32)).sum(), leaves)
        results.append([t.float().cpu() for t in (out, *grads)])
    for name, got, want in zip(["out", "q", "k", "v", "scores"], *results):
        assert rel_err(got, want) < TOL, name


def test_training_kernels_with_sinks_return_the_local_branch_with_its_sinks():
    """a_local (the router's straight-through term) is every query's local output, its sinks included."""
    q, k, v = inputs(1, 2, 1, 40, 40)
    gate = torch.rand(1, 2, 40, generator=torch.Generator().manual_seed(6)) < 0.3
    _, a_local = aha_train_triton(dev(q), dev(k), dev(v), dev(gate), 5, 0.25, tiles=T16, sinks=2)
    everyone_local = torch.zeros_like(gate)
    assert rel_err(a_local.float().cpu(), aha_attention_reference(q, k, v, everyone_local, 5, 0.25, sinks=2)) < TOL


@pytest.mark.parametrize("sinks", [1, 4, 17])
def test_decode_with_sinks_equals_the_reference(sinks):
    """One query per sequence over a longer buffer (kv_len read on the device; NaN past each length, never read)
    from its segment start (kv_start): the sinks go to the first of several splits (16 keys each); a sequence
    whose window holds its sinks, one with no key at all; GQA, global and local heads."""
    b, w = 4, 20
    q, k, v = inputs(b, 4, 2, 1, 120)
    gate = torch.rand(b, 4, 1, generator=torch.Generator().manual_seed(7)) < 0.4
    gate[:, 0], gate[:, 1] = True, False
    lens, starts = [120, 60, 77, 30], [0, 10, 70, 30]  # the third's window holds its sinks; the last has no key
    kb, vb = (torch.cat([t, torch.full((b, 2, 8, 16), float("nan"))], 2) for t in (k, v))
    for i, n in enumerate(lens):
        kb[i, :, n:], vb[i, :, n:] = float("nan"), float("nan")
    out = aha_decode_triton(dev(q), dev(kb), dev(vb), dev(gate[..., 0]), w, 0.25, tiles=dict(SPLIT=16, BLOCK_N=16),
                            kv_start=dev(torch.tensor(starts)), kv_len=dev(torch.tensor(lens)), sinks=sinks)
    out = out.float().cpu()
    for i, (n, s) in enumerate(zip(lens, starts)):
        if s >= n:
            assert not out[i].any()
            continue
        one = slice(i, i + 1)
        want = aha_attention(q[one], k[one, :, :n], v[one, :, :n], gate[one], w, 0.25, row_start=torch.tensor([[s]]),
                             backend="reference", sinks=sinks)
        assert rel_err(out[one], want) < TOL, i


def test_the_op_decodes_with_sinks_on_the_kernels():
    """aha_attention(kv_len=, row_start=, sinks=) on the kernels (the op maps the segment starts to kv_start)
    and on the reference: the same outputs."""
    q, k, v = inputs(3, 4, 2, 1, 60)
    gate = torch.rand(3, 4, 1, generator=torch.Generator().manual_seed(8)) < 0.3
    lens, starts = torch.tensor([60, 41, 25]), torch.tensor([[0], [6], [-1]])
    with torch.no_grad():
        outs = [aha_attention(dev(q, dtype), dev(k, dtype), dev(v, dtype), dev(gate), 7, row_start=dev(starts),
                              kv_len=dev(lens), backend=backend, sinks=3).float().cpu()
                for backend, dtype in (("triton", DTYPE), ("reference", torch.float32))]
    assert rel_err(*outs) < TOL and not outs[0][2].any()


def paged_reference(step, window, sinks):
    """The dense reference of every request of a paged ``Step`` with sinks, rows laid as q's."""
    rows = []
    for r in range(len(step.specs)):
        qs, qe = int(step.query_start[r]), int(step.query_start[r + 1])
        if qs < qe:
            k, v = step.keys(r)
            q = step.q[qs:qe].permute(1, 0, 2)[None]
            out = aha_attention_reference(q, k, v, step.gate[qs:qe].T[None], window, step.d ** -0.5, sinks=sinks)
            rows.append(out[0].permute(1, 0, 2))
    return torch.cat(rows)


@pytest.mark.parametrize("sinks,window", [(1, 3), (4, 8), (17, 20)], ids=lambda x: str(x))
def test_paged_kernel_with_sinks_equals_the_reference(sinks, window):
    """Decode and chunked-prefill requests in one call (the sinks: each request's first positions), GQA, shared
    prefixes, several tiles, key steps and decode splits per request."""
    step = Step(MIXED, p_global=0.2)
    out = step.run(window, tiles=SMALL, sinks=sinks)
    real = int(step.query_start[-1])
    assert rel_err(out[:real], paged_reference(step, window, sinks)) < 1e-4
    assert rel_err(out[:real], paged_reference(step, window, 0)) > 1e-2  # the sinks were read


def test_paged_kernel_with_sinks_in_half_precision():
    step = Step(MIXED, seed=5)
    out = step.run(7, dtype=HALF, tiles=SMALL, sinks=2)
    assert rel_err(out[:int(step.query_start[-1])], paged_reference(step, 7, 2)) < 2e-2


def test_sinks_every_window_holds_change_nothing_bit_for_bit():
    """Where every local query's window holds its sinks (a window past the sequence), the kernels' sink passes
    are empty: the outputs (and gradients) are those of sinks = 0, bit for bit (no key counted twice)."""
    q, k, v = (dev(t) for t in inputs(1, 2, 1, 40, 40))
    gate = dev(torch.rand(1, 2, 40, generator=torch.Generator().manual_seed(9)) < 0.3)
    starts = dev(starts_of("documents", 1, 40))
    prefill = [aha_prefill_triton(q, k, v, gate, 48, 0.25, tiles=T16, row_start=starts, sinks=s) for s in (0, 4)]
    assert torch.equal(*prefill)
    trained = []
    for s in (0, 4):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = aha_train_triton(*leaves, gate, 48, 0.25, tiles=T16, dkdv=T16, row_start=starts, sinks=s)
        trained.append([out, *torch.autograd.grad(out.float().square().sum(), leaves)])
    assert all(torch.equal(a, b) for a, b in zip(*trained))
    decode = [aha_decode_triton(q[..., -1:, :], k, v, gate[..., -1], 48, 0.25, tiles=dict(SPLIT=16, BLOCK_N=16),
                                sinks=s) for s in (0, 4)]
    assert torch.equal(*decode)
    step = Step(MIXED[:4])
    assert torch.equal(step.run(64, tiles=SMALL), step.run(64, tiles=SMALL, sinks=4))
