"""``allhere.softmax``, the one home of the partial-softmax arithmetic, gives to the bit what the formulas it
replaced gave where each was written before: in the paged cache's reference and torch paths (``allhere.ops.paged``), in
the ring (``allhere.distributed.ring`` and ``ring_far``), in dar_latent's fused prefill (``allhere.ops``), in the
decode kernel's split merge (``allhere.kernels``) and in AA-MoE's cache. Each old formula stands below, inline, as
it was; the paths are run once as they are and once with the old formulas put back in their modules' place, and
compared with ``torch.equal`` (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from allhere import softmax
from allhere.distributed import ring, ring_far
from allhere.masks import causal, sliding_window
from allhere.mechanisms.aamoe_cache import AAMoECache
from allhere.mechanisms.base import ContextParallelPlan, FarKV
from allhere.ops.dar_latent import fused
from allhere.ops.dar_latent.check import pack_rows
from allhere.ops.paged import chunks as paged_chunks
from allhere.ops.paged import dar_far
from allhere.ops.paged import decode as paged_decode
from allhere.ops.paged import dispatch as paged_dispatch
from allhere.ops.paged.attention import causal_read, paged_attention, paged_view, window_read, write
from allhere.ops.paged.dar_far import LatentKV, far_pieces, write_latents

# -- the formulas as they were written before ------------------------------------------------------------------


def old_serve_softmax(s):  # paged: chunks.attend, decode._attend_t, dispatch.paged_reference
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    return p, lse


def old_far_softmax(s, inplace=True):  # paged: dar_far._weigh, in place
    lse = torch.logsumexp(s, -1)
    p = s.sub_(lse.clamp_min(torch.finfo(torch.float32).min)[..., None]).exp_()
    return p, lse


def old_paged_merge(found, n_rows: int, d: int, device):  # paged: chunks.merge
    _NEG = float("-inf")
    m = torch.full((n_rows + 1,), _NEG, device=device)  # the last entry takes the padding
    rows = [r.flatten().where(r.flatten() >= 0, n_rows) for r, _, _ in found]
    for r, (_, _, lse) in zip(rows, found):
        m.scatter_reduce_(0, r, lse.flatten(), "amax")
    m.clamp_min_(torch.finfo(torch.float32).min)  # rows that read nothing: weights exp(-inf) = 0, not NaN
    acc = torch.zeros(n_rows + 1, d, device=device)
    den = torch.zeros(n_rows + 1, device=device)
    for r, (_, o, lse) in zip(rows, found):
        w = torch.exp(lse.flatten() - m[r])
        acc.index_add_(0, r, o.reshape(-1, d).float() * w[:, None])
        den.index_add_(0, r, w)
    out = (acc / torch.where(den > 0, den, 1.0)[:, None])[:n_rows]
    return out, (m + torch.log(den))[:n_rows].masked_fill(den[:n_rows] == 0, _NEG)


def old_finite(lse):  # distributed.ring.finite
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def old_ring_merge(o1, l1, o2, l2):  # distributed.ring._merge
    l_new = torch.logaddexp(l1, l2)
    ref = old_finite(l_new)
    return o1 * torch.exp(l1 - ref)[..., None] + o2 * torch.exp(l2 - ref)[..., None], l_new


def old_ring_softmax(s):  # distributed.ring._attend
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - old_finite(lse)[..., None])
    return p, lse


def old_fused_merge(a, b):  # ops.dar_latent.fused._merge
    lse = torch.logaddexp(a[1], b[1])
    out = a[0] * (a[1] - lse).exp().unsqueeze(-1)  # promoted to fp32
    return out.addcmul_(b[0], (b[1] - lse).exp().unsqueeze(-1)), lse


def old_kernel_merge(o_near, o_lat, lse):  # kernels.dar_latent_decode.merge
    top = lse.amax(2, keepdim=True)
    w = torch.exp2(lse - top.clamp_min(-3e38)).unsqueeze(-1)  # -inf rows: weights 0 (not nan)
    total = w.sum(2).clamp_min(1e-30)
    return (w * o_near).sum(2) / total, (w * o_lat).sum(2) / total


def counted(fn, calls: list, name: str):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper


def equal(a, b) -> bool:
    """torch.equal, NaN equal to NaN (a row with nothing to read may hold NaN where a cache is left unwritten)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()) and \
        torch.equal(a.isnan(), b.isnan())


# -- the formulas, alone ---------------------------------------------------------------------------------------


def partials(*shape, empty=0.25, gen=None):
    """Outputs [*shape, 8] and log-sum-exps [*shape], about ``empty`` of the rows reading nothing (-inf)."""
    gen = gen or torch.Generator().manual_seed(0)
    lse = torch.randn(*shape, generator=gen) * 4
    lse = lse.masked_fill(torch.rand(*shape, generator=gen) < empty, float("-inf"))
    return torch.randn(*shape, 8, generator=gen), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_pair_is_the_rings_and_the_fused_paths(dtype):
    gen = torch.Generator().manual_seed(1)
    (o1, l1), (o2, l2) = partials(2, 3, 64, gen=gen), partials(2, 3, 64, gen=gen)
    o1, o2 = o1.to(dtype), o2.to(dtype)
    got = softmax.merge_pair(o1, l1, o2, l2)
    assert all(equal(a, b) for a, b in zip(got, old_ring_merge(o1, l1, o2, l2)))
    got = softmax.merge_pair(o1, l1, o2, l2, fma=True)
    read = torch.isfinite(l1) | torch.isfinite(l2)  # the fused path never has a row that reads neither part
    old = old_fused_merge((o1, l1), (o2, l2))
    assert torch.equal(got[0][read], old[0][read]) and torch.equal(got[1], old[1])
    assert not got[0][~read].any()  # ... where the shared merge gives 0, not NaN


def test_softmax_lse_is_the_serving_codes_and_the_rings():
    s = torch.randn(5, 7, 33) * 3
    s = s.masked_fill(torch.rand(5, 7, 33) < 0.3, float("-inf"))
    s[0, :3] = float("-inf")  # rows that read no key
    for old in (old_serve_softmax, old_ring_softmax):
        assert all(torch.equal(a, b) for a, b in zip(softmax.softmax_lse(s), old(s)))
    got, want = softmax.softmax_lse(s.clone(), inplace=True), old_far_softmax(s.clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    lse = torch.logsumexp(s, -1)
    assert torch.equal(torch.exp(s - softmax.clamp_empty(lse)[..., None]), torch.exp(s - old_finite(lse)[..., None]))


def test_merge_pieces_is_the_paged_merge():
    gen = torch.Generator().manual_seed(2)
    found = []
    for n in (5, 3, 4):  # pieces of rows scattered over 12 rows (some read by several pieces, some by none)
        o, lse = partials(n, 4, gen=gen)
        rows = torch.randint(-1, 12, (n, 4), generator=gen)
        found.append((rows, o.to(torch.bfloat16) if n == 3 else o, lse))
    got, want = softmax.merge_pieces(found, 12, 8, "cpu"), old_paged_merge(found, 12, 8, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_merge_splits_is_the_decode_kernels_merge():
    o_near, lse = partials(2, 2, 5, 9, gen=torch.Generator().manual_seed(3))  # [b, kv heads, splits, rows]
    lse[0, 0, :, :2] = float("-inf")  # rows no split saw
    o_lat = torch.randn(2, 2, 5, 9, 6)
    got = softmax.merge_splits(lse, o_near, o_lat, dim=2, base2=True)
    assert all(torch.equal(a, b) for a, b in zip(got, old_kernel_merge(o_near, o_lat, lse)))


def test_merge_lse_is_the_aamoe_caches_normaliser():
    cache = AAMoECache(chunk=4)
    u = torch.randn(2, 12)
    total = None
    for part in u.split([5, 1, 6], dim=1):
        cache.seen += part.shape[1]
        cache.update_normaliser(part)
        lse = torch.logsumexp(part, -1)
        total = lse if total is None else torch.logaddexp(total, lse)  # the cache's old formula
        assert torch.equal(cache.lse, total)


# -- the paths -------------------------------------------------------------------------------------------------

HEADS, KV_HEADS, D, BS, D_DOWN = 4, 2, 8, 4, 6


def paged_case(gen):
    """Three requests in scattered blocks of a paged cache, one of them decoding (one query this step), AHA's two
    classes of rows; their latents in a cache of their own (DAR's far pieces)."""
    lengths, q_lens = [13, 6, 9], [5, 1, 9]
    table = torch.randperm(12, generator=gen)[:12].view(3, 4).int()
    view = paged_view(torch.zeros(12, KV_HEADS, BS, 2 * D), BS, KV_HEADS, D)
    latents = torch.zeros(12, BS, D_DOWN)
    for r, n in enumerate(lengths):
        slots = torch.tensor([int(table[r, p // BS]) * BS + p % BS for p in range(n)])
        write(view, slots, torch.randn(n, KV_HEADS, D, generator=gen), torch.randn(n, KV_HEADS, D, generator=gen))
        write_latents(latents, slots, torch.randn(n, D_DOWN, generator=gen))
    n = sum(q_lens)
    q = torch.randn(n, HEADS, D, generator=gen)
    starts = torch.tensor([0, 5, 6, 15])
    gate = torch.rand(n, HEADS, generator=gen) < 0.4
    w_k = torch.randn(D_DOWN, KV_HEADS * D, generator=gen)
    kv = LatentKV(lambda c, pos: (c.float() @ w_k).view(*c.shape[:2], KV_HEADS, D),
                  torch.randn(KV_HEADS, D, D_DOWN, generator=gen), torch.randn(KV_HEADS, D, generator=gen))
    return q, view, starts, torch.tensor(lengths), table, gate, latents, kv


def test_the_paged_reference_as_before(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    q, view, starts, lens, table, gate, latents, kv = paged_case(gen)
    sinks = torch.randn(HEADS, generator=gen)

    def run():
        out = torch.zeros(q.shape[0], HEADS, D)
        extra = list(far_pieces(q, latents, starts, lens, table, 3, kv, D ** -0.5))
        paged_dispatch.paged_reference(q, view, starts, lens, table, [[window_read(3)], [causal_read()]], D ** -0.5,
                                       out, row_class=gate.long(), sinks=sinks, extra=extra)
        return out

    new, calls = run(), []
    monkeypatch.setattr(paged_dispatch, "softmax_lse", counted(old_serve_softmax, calls, "softmax"))
    monkeypatch.setattr(paged_dispatch, "merge_pieces", counted(old_paged_merge, calls, "merge"))
    monkeypatch.setattr(dar_far, "softmax_lse", counted(old_far_softmax, calls, "far"))
    assert torch.equal(new, run())
    assert {"softmax", "merge", "far"} <= set(calls)


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["fused", "softcap"])
def test_the_paged_torch_path_as_before(softcap, monkeypatch):
    """The torch path: prefill tiles (torch's fused attention, or the matmul softmax with capped scores), the
    decode rows, the far pieces, the merge of them all."""
    gen = torch.Generator().manual_seed(5)
    q, view, starts, lens, table, gate, latents, kv = paged_case(gen)
    monkeypatch.setattr(paged_chunks, "MERGE_BUDGET", 0)  # pieces folded as they come: merges of merges

    def run():
        out = torch.zeros(q.shape[0], HEADS, D)
        paged_attention(q, view, starts, lens, table, [[window_read(3)], [causal_read()]], D ** -0.5, out,
                        row_class=gate.long(), softcap=softcap, q_tile=4,
                        extra=far_pieces(q, latents, starts, lens, table, 3, kv, D ** -0.5))
        return out

    new, calls = run(), []
    for module in (paged_chunks, paged_decode):
        monkeypatch.setattr(module, "softmax_lse", counted(old_serve_softmax, calls, "softmax"))
    monkeypatch.setattr(dar_far, "softmax_lse", counted(old_far_softmax, calls, "far"))
    monkeypatch.setattr(paged_chunks, "merge_pieces", counted(old_paged_merge, calls, "merge"))
    assert torch.equal(new, run())
    assert {"softmax", "merge", "far"} <= set(calls)


@pytest.fixture
def one_rank():
    """A process group of one rank (gloo), for the ring's plans in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ring_inputs(gen, n=24):
    q = torch.randn(2, HEADS, n, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, KV_HEADS, n, D, generator=gen, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(2, HEADS, n, D, generator=gen)


def forward_backward(fn, q, k, v, dout):
    for t in (q, k, v):
        t.grad = None
    out = fn()
    (out * dout).sum().backward()
    return [out.detach()] + [t.grad.clone() for t in (q, k, v)]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("kind", ["causal", "sliding", "aha", "far"])
def test_the_rings_plans_as_before(kind, layout, one_rank, monkeypatch):
    """The ring's forward and backward on one rank (every block of the plan merged into its rows: whole blocks and
    the gathered global rows of AHA's), and ``ring_far``'s DAR-like plan (near keys full, far ones expanded)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, dout = ring_inputs(gen)
    gate = torch.rand(2, HEADS, q.shape[2], generator=gen) < 0.3
    payload = torch.randn(2, q.shape[2], D_DOWN, generator=gen, requires_grad=True)
    w_k, w_v = torch.randn(D_DOWN, KV_HEADS * D, generator=gen), torch.randn(D_DOWN, KV_HEADS * D, generator=gen)

    def expand(p, pos):
        return tuple((p @ w).view(p.shape[0], -1, KV_HEADS, D).transpose(1, 2) for w in (w_k, w_v))

    def fn():
        if kind == "causal":
            return ring.ring_attention(q, k, v, None, layout=layout)
        if kind == "sliding":
            return ring.ring_attention(q, k, v, sliding_window(5), layout=layout)
        if kind == "aha":
            return ring.ring_aha_attention(q, k, v, gate, 5, layout=layout)
        plan = ContextParallelPlan(reads=causal, far=FarKV(payload, expand, sliding_window(5)))
        return ring_far.ring_far_attention(q, k, v, plan, layout=layout)

    new, calls = forward_backward(fn, q, k, v, dout), []
    monkeypatch.setattr(ring, "merge_pair", counted(old_ring_merge, calls, "merge"))
    monkeypatch.setattr(ring, "softmax_lse", counted(old_ring_softmax, calls, "softmax"))
    for module in (ring, ring_far):
        monkeypatch.setattr(module, "clamp_empty", counted(old_finite, calls, "guard"))
    old = forward_backward(fn, q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(new, old))
    assert set(calls) == ({"guard"} if kind == "far" else {"merge", "softmax", "guard"})


def latent_inputs(gen, lq, lk, near, b=2, h=4, g=2, d=16, e_r=4, d_c=12, dtype=torch.float32):
    t = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    x = dict(q=t(b, h, lq, d), q_far=t(b, h, lq, d), k_near=t(b, g, near, d), v_near=t(b, g, near, d),
             rows=pack_rows(t(b, lk, d_c), t(b, g, lk, e_r)), w_uk=t(g, d - e_r, d_c) / d_c ** 0.5,
             w_uv=t(g, d, d_c) / d_c ** 0.5)
    return {k: v.to(dtype) if k in ("q", "q_far", "k_near", "v_near", "rows") else v for k, v in x.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lq,lk,near,window", [(40, 40, 40, 5), (24, 40, 28, 5), (1, 30, 6, 6), (24, 40, 40, 30)],
                         ids=["prefill", "chunk", "decode", "wide-window"])
def test_dar_latents_fused_path_as_before(lq, lk, near, window, dtype, monkeypatch):
    """dar_latent's fused prefill: the near band or causal tail merged with the far keys' two parts."""
    x = latent_inputs(torch.Generator().manual_seed(7), lq, lk, near, dtype=dtype)
    new, calls = fused.dar_latent_attention_fused(**x, window=window), []
    old = lambda o1, l1, o2, l2, fma: old_fused_merge((o1, l1), (o2, l2))  # noqa: E731
    monkeypatch.setattr(fused, "merge_pair", counted(old, calls, "merge"))
    assert torch.equal(new, fused.dar_latent_attention_fused(**x, window=window))
    assert calls
