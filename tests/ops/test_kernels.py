"""Triton kernels against the dense reference: compiled on a GPU, in Triton's interpreter on the CPU."""

import random

import pytest
import torch

pytest.importorskip("triton")  # on the CPU, conftest.py has chosen Triton's interpreter

from allhere.kernels import aha_pack  # noqa: E402
from allhere.kernels.aha_common import tma_checked  # noqa: E402
from allhere.kernels.aha_decode import aha_decode_triton  # noqa: E402
from allhere.kernels.aha_pack import longest_first, longest_first_torch, pack_global, pack_global_torch  # noqa: E402
from allhere.kernels.aha_prefill import aha_prefill_triton  # noqa: E402
from allhere.kernels.aha_train import aha_train_triton, segment_end  # noqa: E402
from allhere.masks import segment_starts  # noqa: E402
from allhere.ops.aha import aha_attention, aha_attention_reference, fast, triton_path  # noqa: E402
from allhere.ops.sliding import sliding_window_attention_reference  # noqa: E402
from allhere.ops.ste import straight_through  # noqa: E402

from helpers import rel_err, segment_mask, spy_paths  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiles(block_m, block_n):
    """A pinned launch setting (the rest from each kernel's default)."""
    return dict(BLOCK_M=block_m, BLOCK_N=block_n)


T16 = tiles(16, 16)
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
            "all-local": torch.zeros(b, h, n, dtype=torch.bool),
            "all-global": torch.ones(b, h, n, dtype=torch.bool)}[pattern]
    if pattern == "mixed":
        gate[:, 0] = True  # a busy head next to rare ones: packed per head, each with its own count
    out = run(aha_prefill_triton, q, k, v, gate.to(DEVICE), w, d ** -0.5, tiles=T16)
    assert rel_err(out, aha_attention_reference(q, k, v, gate, w)) < TOL


def mixed_gate(b, h, n, p, seed=1):
    gate = torch.rand(b, h, n, generator=torch.Generator().manual_seed(seed)) < p
    gate[:, 0] = True  # a busy head next to rare ones
    return gate


def train_and_reference(q, k, v, gate, w, mask=None, **kernel_args):
    """([out, dq, dk, dv] of the training kernels, the same of the fp32 reference under ``mask``, the
    kernels' a_local), for one random upstream gradient."""
    up = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    leaves = [t.to(DEVICE, DTYPE).requires_grad_() for t in (q, k, v)]
    out, a_local = aha_train_triton(*leaves, gate.to(DEVICE), w, q.shape[-1] ** -0.5, **kernel_args)
    got = [out, *torch.autograd.grad((out.float() * up.to(DEVICE)).sum(), leaves)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = aha_attention_reference(*ref_leaves, gate, w, mask=mask)
    want = [ref, *torch.autograd.grad((ref * up).sum(), ref_leaves)]
    return [t.float().cpu() for t in got], want, a_local.float().cpu()


@pytest.mark.parametrize("b,h,hkv,n,d,w,gates,bm,bn", [
    (2, 4, 2, 50, 16, 7, "mixed", 16, 16), (1, 2, 1, 33, 32, 40, "mixed", 16, 32),
    (1, 4, 4, 70, 16, 1, "one head", 32, 16), (1, 4, 1, 45, 16, 3, "all-global", 16, 16),
    (1, 2, 2, 40, 16, 5, "all-local", 16, 16)])
def test_training_kernels_give_the_reference_outputs_and_gradients(b, h, hkv, n, d, w, gates, bm, bn):
    q, k, v = inputs(b, h, hkv, n, n, d)
    gate = {"mixed": lambda: mixed_gate(b, h, n, 0.3), "one head": lambda: mixed_gate(b, h, n, 0.0),
            "all-global": lambda: torch.ones(b, h, n, dtype=torch.bool),
            "all-local": lambda: torch.zeros(b, h, n, dtype=torch.bool)}[gates]()
    got, want, a_local = train_and_reference(q, k, v, gate, w, tiles=tiles(bm, bn))
    assert rel_err(a_local, sliding_window_attention_reference(q, k, v, w)) < TOL
    for name, a, r in zip(["out", "q", "k", "v"], got, want):
        assert rel_err(a, r) < TOL, name


# (document boundaries, left padding per sequence[, right padding per sequence])
SEGMENTS = {"left-pad": ([], [0, 5]), "right-pad": ([], [0, 0], [3, 0]), "documents": ([13, 31, 32], [0, 0]),
            "documents+pad": ([21, 40], [0, 7]), "nothing-real": ([], [19, 50])}


@pytest.mark.slow
@pytest.mark.parametrize("layout", SEGMENTS)
@pytest.mark.parametrize("kernel", ["prefill", "training"])
@pytest.mark.parametrize("w", [6, 40])
def test_kernels_with_segments_equal_the_reference_with_the_mask(layout, kernel, w):
    """Padded sequences and packed documents in one launch (row_start): values and, for training, the
    gradients of q, k, v equal the reference under the same mask; queries that see nothing give zero.
    (w = 40 with blocks of 16: key blocks inside every row's window, which run without a mask.)"""
    b, h, hkv, n, d = 2, 4, 2, 50, 16
    q, k, v = inputs(b, h, hkv, n, n, d)
    mask = segment_mask(b, n, n, *SEGMENTS[layout])
    starts = segment_starts(mask, n, n)
    gate = mixed_gate(b, h, n, 0.3)
    if kernel == "prefill":
        out = run(aha_prefill_triton, q, k, v, gate.to(DEVICE), w, d ** -0.5, tiles=T16, row_start=starts.to(DEVICE))
        assert rel_err(out, aha_attention_reference(q, k, v, gate, w, mask=mask)) < TOL
        return
    got, want, _ = train_and_reference(q, k, v, gate, w, mask, tiles=T16, row_start=starts.to(DEVICE))
    for name, a, r in zip(["out", "q", "k", "v"], got, want):
        assert rel_err(a, r) < TOL, name


@pytest.mark.parametrize("seed", range(12))
def test_kernels_on_random_shapes_windows_blocks_and_segments(seed, monkeypatch):
    """Random sizes, GQA, windows (1 to longer than the sequence), block sizes, gate densities, document
    boundaries and left or right padding: prefill and training (values and gradients) equal the reference.
    Odd seeds start the global blocks longest first (sorted), even ones in the fixed order of short
    sequences."""
    if seed % 2:
        monkeypatch.setattr(aha_pack, "SORT_FROM", 0)
    rng = random.Random(seed)
    b, hkv, n = rng.choice([1, 2]), rng.choice([1, 2]), rng.randint(5, 90)
    h, w, bm, bn = hkv * rng.choice([1, 2]), rng.choice([1, 3, 17, 40, 100]), rng.choice([16, 32]), rng.choice([16, 32])
    bounds = sorted(rng.sample(range(1, n), rng.randint(0, 3)))
    pads = [rng.choice([(0, 0), (rng.randint(0, n), 0), (0, rng.randint(0, n))]) for _ in range(b)]
    mask = segment_mask(b, n, n, bounds, *zip(*pads))  # left or right padding or none
    q, k, v = inputs(b, h, hkv, n, n, 16, seed=seed)
    gate = torch.rand(b, h, n, generator=torch.Generator().manual_seed(seed)) < rng.choice([0.0, 0.1, 0.5, 1.0])
    starts = segment_starts(mask, n, n).to(DEVICE)
    got, want, _ = train_and_reference(q, k, v, gate, w, mask, tiles=tiles(bm, bn), row_start=starts,
                                       dkdv=tiles(rng.choice([16, 32, 64]), rng.choice([16, 32])))
    got.append(run(aha_prefill_triton, q, k, v, gate.to(DEVICE), w, 0.25, tiles(bm, bn), row_start=starts))
    want.append(want[0])
    for name, a, r in zip(["out", "q", "k", "v", "prefill"], got, want):  # w = 1: dq = dk = 0, hence max(|r|, 1)
        assert (a - r).norm() / max(r.norm(), 1.0) < TOL, name


def test_segment_end_is_one_past_each_runs_last_query():
    start = torch.tensor([[50, 50, 2, 2, 2, 5, 50], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    assert segment_end(start).tolist() == [[2, 2, 5, 5, 5, 6, 7], [7] * 7]


@pytest.mark.parametrize("layout", [None, "documents+pad"])
def test_op_takes_the_kernels_and_the_router_gets_its_gradient(monkeypatch, layout):
    """aha_attention with backend "triton" (on the CPU: Triton's interpreter), without and with segments
    (one launch, a_full from the prefill kernels): values, and q, k, v and the router scores get the
    reference's straight-through gradients."""
    calls = spy_paths(monkeypatch)
    monkeypatch.setattr(fast, "_per_segment", None)  # the kernels must not need it
    n = 50
    q, k, v = inputs(2, 4, 2, n, n, 16)
    scores = torch.rand(2, 4, n, generator=torch.Generator().manual_seed(3))
    up = torch.randn(2, 4, n, 16)
    mask = None if layout is None else segment_mask(2, n, n, *SEGMENTS[layout])
    starts = None if mask is None else segment_starts(mask, n, n)
    results = []
    for backend, dtype, dev in (("triton", DTYPE, DEVICE), ("reference", torch.float32, "cpu")):
        leaves = ([t.clone().to(dev, dtype).requires_grad_() for t in (q, k, v)]
                  + [scores.clone().to(dev).requires_grad_()])
        rs = None if starts is None else starts.to(dev)
        out = aha_attention(*leaves[:3], straight_through(leaves[3], 0.5), 6, row_start=rs, backend=backend)
        results.append([out.detach()] + list(torch.autograd.grad((out.float() * up.to(dev)).sum(), leaves)))
        with torch.no_grad():  # the prefill kernels
            results[-1].append(aha_attention(*(t.detach() for t in leaves[:3]), leaves[3] > 0.5, 6, row_start=rs,
                                             backend=backend))
    assert calls.count(("aha", "triton")) == 2
    for name, got, want in zip(["out", "q", "k", "v", "scores", "no grad"], *results):
        assert rel_err(got.float().cpu(), want.float().cpu()) < TOL, name


def test_the_kernels_take_head_dims_16_to_128_only():
    takes = {d: triton_path.triton_refusal(*(torch.zeros(1, 2, 8, d, dtype=torch.bfloat16, device=DEVICE)
                                             for _ in range(3)), torch.zeros(1, 2, 8, dtype=torch.bool)) is None
             for d in (8, 16, 64, 80, 128, 256)}
    assert takes == {8: False, 16: True, 64: True, 80: False, 128: True, 256: False}


def test_packing_lists_each_heads_global_positions_and_counts_them():
    gate = torch.zeros(1, 3, 40, dtype=torch.bool)
    gate[0, 0, :35] = True  # 35 pairs
    gate[0, 2, [5, 9]] = True  # 2 pairs; head 1 has none
    rows, cum = (t.cpu() for t in pack_global(gate.to(DEVICE)))
    assert rows.shape == (3, 41) and cum.shape == (3, 40) and rows.dtype == cum.dtype == torch.int32
    assert rows[0, :35].tolist() == list(range(35)) and rows[2, :2].tolist() == [5, 9]
    assert cum[:, -1].tolist() == [35, 0, 2] and cum[2, [4, 5, 8, 9, 39]].tolist() == [0, 1, 1, 2, 2]


@pytest.mark.parametrize("b,h,hkv,t,d,w,split", [(2, 4, 2, 150, 16, 7, 32), (1, 2, 1, 33, 32, 40, 64),
                                                  (3, 4, 4, 100, 16, 1, 16), (2, 2, 1, 150, 16, 5, 8),
                                                  (2, 4, 2, 150, 16, 40, 16)])  # a window over 3 splits
def test_decode_equals_reference(b, h, hkv, t, d, w, split):
    q, k, v = inputs(b, h, hkv, 1, t, d)
    gate = torch.rand(b, h, 1, generator=torch.Generator().manual_seed(2)) < 0.5
    gate[0, 0], gate[-1, -1] = True, False
    out = run(aha_decode_triton, q, k, v, gate[..., 0].to(DEVICE), w, d ** -0.5,
              tiles=dict(SPLIT=split, BLOCK_N=16))
    assert rel_err(out, aha_attention_reference(q, k, v, gate, w)) < TOL


def test_decode_merges_in_its_last_split_and_leaves_the_counters_zero():
    """One launch: the last split of a head to finish merges its splits (an atomic count per (sequence, head),
    set back to zero for the next call); the same call twice gives the same output."""
    from allhere.kernels import aha_common

    q, k, v = inputs(2, 4, 2, 1, 150, 16)
    gate = torch.tensor([[True, False, True, True], [False, True, False, False]])
    calls = [run(aha_decode_triton, q, k, v, gate.to(DEVICE), 20, 16 ** -0.5, tiles=dict(SPLIT=16, BLOCK_N=16))
             for _ in range(2)]
    assert torch.equal(calls[0], calls[1])
    assert rel_err(calls[0], aha_attention_reference(q, k, v, gate[..., None], 20)) < TOL
    assert aha_common._ARRIVED and not any(c.any() for c in aha_common._ARRIVED.values())
    empty = run(aha_decode_triton, q, k[:, :, :0], v[:, :, :0], gate.to(DEVICE), 20, 16 ** -0.5)
    assert empty.shape == (2, 4, 1, 16) and not empty.any()  # no key at all: zero


def test_decode_with_left_padding_equals_reference_with_the_mask():
    q, k, v = inputs(3, 4, 2, 1, 90, 16)
    gate = torch.rand(3, 4, 1, generator=torch.Generator().manual_seed(4)) < 0.5
    gate[:, 0] = True
    starts = torch.tensor([0, 37, 90])  # no padding; padding; nothing real at all
    mask = torch.stack([torch.arange(90) >= s for s in starts])[:, None, None, :]
    out = run(aha_decode_triton, q, k, v, gate[..., 0].to(DEVICE), 6, 16 ** -0.5,
              tiles=dict(SPLIT=32, BLOCK_N=16), kv_start=starts.to(DEVICE))
    assert rel_err(out, aha_attention_reference(q, k, v, gate, 6, mask=mask)) < TOL
    assert out[2].abs().max() == 0
    with torch.no_grad():  # the op maps segment starts to kv_start
        via_op = aha_attention(*(t.to(DEVICE, DTYPE) for t in (q, k, v)), gate.to(DEVICE), 6,
                               row_start=torch.tensor([[0], [37], [-1]], device=DEVICE), backend="triton")
    assert rel_err(via_op.float().cpu(), out) < TOL


def test_decode_with_lengths_on_the_device_reads_each_sequence_and_launches_the_same(monkeypatch):
    """kv_len: each sequence's own length in a longer buffer (what lies past it, here NaN, is never read);
    the launch (grid and every argument but the tensors' contents) is the same whatever the lengths, as a
    captured CUDA graph replays it; with kv_start too, each sequence reads [start, length)."""
    from allhere.kernels import aha_common, aha_decode

    launches = []
    real = aha_decode._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, [a.shape if torch.is_tensor(a) else a for a in args], kwargs))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(aha_decode, "_decode_kernel", Spy())
    q, k, v = inputs(3, 4, 2, 1, 120, 16)
    gate = torch.rand(3, 4, 1, generator=torch.Generator().manual_seed(5)) < 0.5
    gate[:, 0], gate[:, 1] = True, False
    pinned = dict(SPLIT=32, BLOCK_N=16)
    for lens, starts in (([120, 1, 77], None), ([50, 90, 33], None), ([60, 0, 100], [10, 0, 99])):
        kb, vb = (torch.cat([t, torch.full((3, 2, 40, 16), float("nan"))], 2) for t in (k, v))  # room for 40 more
        for i, n in enumerate(lens):  # the buffer past each sequence's length: never read
            kb[i, :, n:], vb[i, :, n:] = float("nan"), float("nan")
        kw = dict(kv_len=torch.tensor(lens, device=DEVICE))
        if starts is not None:
            kw["kv_start"] = torch.tensor(starts, device=DEVICE)
        out = run(aha_decode_triton, q, kb, vb, gate[..., 0].to(DEVICE), 9, 16 ** -0.5, tiles=pinned, **kw)
        for i, n in enumerate(lens):
            lo = 0 if starts is None else starts[i]
            if n - lo <= 0:  # no key at all: zero
                assert not out[i].any()
                continue
            want = aha_attention_reference(q[i:i + 1], k[i:i + 1, :, lo:n], v[i:i + 1, :, lo:n], gate[i:i + 1], 9)
            assert rel_err(out[i:i + 1], want) < TOL, (lens, starts, i)
    assert len({repr(launch) for launch in launches[:2]}) == 1  # the same launch for other lengths
    assert not any(c.any() for c in aha_common._ARRIVED.values())  # every count back to zero


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_the_op_takes_decode_lengths_on_every_path(backend):
    """aha_attention(kv_len=): the kernels read the lengths on the device, the other paths take each
    sequence's keys apart; the same outputs. A call that is no decode step, or a length out of range, is
    refused."""
    q, k, v = inputs(2, 4, 2, 1, 60, 16)
    gate = torch.rand(2, 4, 1, generator=torch.Generator().manual_seed(6)) < 0.5
    lens = torch.tensor([25, 60])
    dev = lambda t: t.to(DEVICE, DTYPE)  # noqa: E731
    with torch.no_grad():
        out = aha_attention(dev(q), dev(k), dev(v), gate.to(DEVICE), 5, backend=backend,
                            kv_len=lens.to(DEVICE)).float().cpu()
        for i, n in enumerate(lens.tolist()):
            want = aha_attention_reference(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], gate[i:i + 1], 5)
            assert rel_err(out[i:i + 1], want) < TOL
        with pytest.raises(ValueError, match="one decode query per sequence"):
            aha_attention(*inputs(2, 4, 2, 60, 60, 16), torch.ones(2, 4, 60, dtype=torch.bool), 5, kv_len=lens)
        if backend != "triton":  # the kernels would read a length past the buffer as the buffer's length
            with pytest.raises(ValueError, match=r"kv_len\[1\] = 61"):
                aha_attention(q, k, v, gate, 5, backend=backend, kv_len=torch.tensor([3, 61]))


def test_global_blocks_start_longest_first_across_heads():
    """Work items (head, block of 4 packed queries): ordered by the last position each block reaches,
    across heads; blocks past a head's count come last."""
    gate = torch.zeros(1, 3, 12, dtype=torch.bool)
    gate[0, 0, [0, 1, 2, 3, 4, 11]] = True  # blocks: rows 0-3 (reach 3), rows 4, 11 (reach 11)
    gate[0, 2, [5, 7]] = True  # one block reaching 7; head 1 has none
    order = longest_first(*pack_global(gate.to(DEVICE)), 4).tolist()
    per_head = 3
    assert order[:3] == [0 * per_head + 1, 2 * per_head + 0, 0 * per_head + 0]
    assert sorted(order) == list(range(9))  # every item once: the 6 empty ones after


@pytest.mark.parametrize("b,h,n,block_m", [(2, 3, 100, 4), (1, 2, 37, 16), (3, 1, 16, 1), (1, 4, 1, 8)])
def test_packing_kernels_equal_their_torch_references(b, h, n, block_m, monkeypatch):
    """The packing in one launch each (``aha_pack``) = the same in torch ops, with programs that loop over
    several chunks of positions and of blocks (chunks of 16 here), a float gate, a strided one, all-global
    and all-local heads, a sequence of one."""
    monkeypatch.setattr(aha_pack, "CHUNK", 16)
    gate = torch.rand(b, h, n, generator=torch.Generator().manual_seed(n)) < 0.3
    gate[0, 0] = True
    gate[-1, -1] = False
    strided = torch.zeros(b, h, 2 * n, dtype=torch.bool)
    strided[..., ::2] = gate
    for g in (gate, gate.float(), strided[..., ::2]):  # the last a view with a step: not contiguous
        rows, cum = pack_global(g.to(DEVICE))
        want_rows, want_cum = pack_global_torch(g)
        assert torch.equal(cum.cpu(), want_cum)
        for r, c in enumerate(want_cum[:, -1].tolist()):  # the entries past a head's count are never read
            assert torch.equal(rows[r, :c].cpu(), want_rows[r, :c])
        order = longest_first(rows, cum, block_m)
        assert torch.equal(order.cpu(), longest_first_torch(want_rows, want_cum, block_m))


@pytest.mark.parametrize("kernel", ["prefill", "training"])
def test_tensor_descriptor_path_equals_the_reference(kernel):
    """The key loops through tensor descriptors (TMA on Hopper; Triton's interpreter runs them on the
    CPU), with segments and keys past the end of a block (n = 50, blocks of 16): values and gradients."""
    b, h, hkv, n, d, w = 2, 4, 2, 50, 16, 6
    q, k, v = inputs(b, h, hkv, n, n, d)
    mask = segment_mask(b, n, n, *SEGMENTS["documents+pad"])
    starts = segment_starts(mask, n, n).to(DEVICE)
    gate = mixed_gate(b, h, n, 0.3)
    tma = dict(BLOCK_M=16, BLOCK_N=16, TMA=True)
    if kernel == "prefill":
        out = run(aha_prefill_triton, q, k, v, gate.to(DEVICE), w, d ** -0.5, tiles=tma, row_start=starts)
        assert rel_err(out, aha_attention_reference(q, k, v, gate, w, mask=mask)) < TOL
        return
    got, want, _ = train_and_reference(q, k, v, gate, w, mask, tiles=tma, row_start=starts)
    for name, a, r in zip(["out", "q", "k", "v"], got, want):
        assert rel_err(a, r) < TOL, name


def test_tensor_descriptors_only_where_the_layout_allows_them():
    k = torch.zeros(2, 2, 40, 16)
    assert tma_checked(dict(TMA=True), k)["TMA"] is True
    assert tma_checked(dict(TMA=True), k.flatten()[1:].view(-1)[:2 * 2 * 39 * 16].view(2, 2, 39, 16))["TMA"] is False
    assert tma_checked(dict(BLOCK_M=16), k) == dict(BLOCK_M=16)
