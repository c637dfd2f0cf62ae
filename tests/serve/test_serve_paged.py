"""allhere's batched attention over a paged KV cache (allhere.ops.paged.attention; what vLLM serving runs for AHA,
sinks, the other masked patterns and DAR) equals the dense references: requests written in chunks to scattered
blocks (chunked prefill, then decode steps beside other requests' prefill), a request whose first blocks come from
another's (a prefix-cache hit), padding slots and rows. No vLLM needed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import allhere as ah
from allhere import registry
from allhere.backend import dispatch, select
from allhere.masks import causal, sliding_window
from allhere.ops.aha import aha_attention_reference
from allhere.ops.dar import dar_attention_reference
from allhere.ops.dar_latent.check import query_rows
from allhere.ops.full import pattern_attention_reference
from allhere.ops.paged import chunks as paged_chunks
from allhere.ops.paged.aha_triton import aha_paged, kernel_refusal
from allhere.ops.paged.attention import (
    Read,
    causal_read,
    paged_attention,
    paged_view,
    token_positions,
    window_read,
    write,
)
from allhere.ops.paged.dar_far import LatentKV, far_pieces, rotary_projection, write_latents
from allhere.ops.paged.step_plan import PagedStepPlan
from allhere.softmax import merge_pieces

HEADS, KV_HEADS, D, BS = 4, 2, 8, 4  # 2 query heads per kv head; blocks of 4 tokens
D_DOWN, BS_LATENT, ROTATED = 6, 8, 6  # DAR's latents: 6 numbers per token, in blocks of 8; rotary on 6 of D
SMALL_BUDGET = 4 * 8 * (D_DOWN + KV_HEADS * D + HEADS)  # bytes of a piece of far keys: 8 keys (many pieces)
LENGTHS = [29, 5, 17]  # tokens per request; request 3 (PREFIXED) reuses the first SHARED of request 0
SHARED, PREFIXED = 16, 21
SCALE = D ** -0.5


# per step, request -> its next tokens (None: the rest): chunks of prompts beside other requests' single
# (decode) tokens; request 3 joins at step 2 once request 0 has written its first SHARED tokens
STEPS = [{0: 12, 1: 3, 2: 7}, {0: 6, 1: 2, 2: 6}, {0: 1, 2: 1, 3: 3}, {0: 1, 2: 1, 3: 1}, {0: None, 2: None, 3: None}]


def _table(gen, bs):
    """A block table of blocks of ``bs`` tokens for LENGTHS + the prefixed request, scattered over a pool with 3
    spare blocks, request 3's first SHARED tokens in request 0's blocks (SHARED a multiple of ``bs``); -1 past a
    request's blocks. Returns (table, pool size)."""
    lengths = LENGTHS + [PREFIXED]
    n_blocks = sum(-(-n // bs) for n in LENGTHS) + -(-(PREFIXED - SHARED) // bs)
    order = torch.randperm(n_blocks + 3, generator=gen)[:n_blocks].tolist()  # scattered, in no order
    table = torch.full((4, -(-max(lengths) // bs)), -1, dtype=torch.int32)
    for r, n in enumerate(LENGTHS):
        for b in range(-(-n // bs)):
            table[r, b] = order.pop()
    table[3, : SHARED // bs] = table[0, : SHARED // bs]
    for b in range(SHARED // bs, -(-PREFIXED // bs)):
        table[3, b] = order.pop()
    return table, n_blocks + 3


def _serve(reads, gen, gate=None, q_tile=4, latent=None, d=D, kernel_window=None, path="torch", positions=None,
           **options):
    """Serve LENGTHS (+ the prefixed request) step by step as vLLM schedules them (STEPS), each step's K/V
    written first (with a padding slot), then attended (with a padding row after the real ones). Request 3
    starts with its first SHARED tokens already cached (request 0's blocks). ``latent``: (LatentKV, window, budget):
    also latents of D_DOWN per token in a cache of their own (blocks of BS_LATENT, another table), their far
    rows (``far_pieces``) joined. Returns per request its outputs [length, heads, d] (rows before SHARED of
    request 3: never computed) and [q, (k, v), gate [length, heads] or None, latents or None]. ``kernel_window``:
    AHA with this window through the Triton paged kernel (``aha_triton.aha_paged``) instead of ``reads``;
    ``path``: the backend of op family "paged" that computes the others (``allhere.ops.paged.dispatch``).
    ``positions``: a ``PagedStepPlan`` of each step -> the token positions handed to the op (None: none)."""
    lengths = LENGTHS + [PREFIXED]
    table, pool = _table(gen, BS)
    view = paged_view(torch.zeros(pool, KV_HEADS, BS, 2 * d), BS, KV_HEADS, d)
    if latent is not None:
        latent_table, latent_pool = _table(gen, BS_LATENT)
        latent_cache = torch.zeros(latent_pool, 1, BS_LATENT, D_DOWN + 3)[:, 0, :, 1:D_DOWN + 1]  # strided
    data = []
    for n in lengths:
        kv = (torch.randn(n, KV_HEADS, d, generator=gen), torch.randn(n, KV_HEADS, d, generator=gen))
        g = torch.rand(n, HEADS, generator=gen) < 0.3 if gate is None else None
        c = torch.randn(n, D_DOWN, generator=gen) if latent is not None else None
        data.append([torch.randn(n, HEADS, d, generator=gen), kv, g, c])
    data[3][0][:SHARED] = data[0][0][:SHARED]  # the shared prefix: the same tokens
    for t in (0, 1):
        data[3][1][t][:SHARED] = data[0][1][t][:SHARED]
    if latent is not None:
        data[3][3][:SHARED] = data[0][3][:SHARED]
    outs = [torch.full((n, HEADS, d), float("nan")) for n in lengths]
    done = [0, 0, 0, SHARED]
    for step in STEPS:
        rows, starts, lens = [], [0], []
        for r, take in step.items():
            b = lengths[r] if take is None else done[r] + take
            rows.append((r, done[r], b))
            starts.append(starts[-1] + b - done[r])
            lens.append(b)
            done[r] = b
        q = torch.cat([data[r][0][a:b] for r, a, b in rows])
        slots = torch.tensor([int(table[r, p // BS]) * BS + p % BS for r, a, b in rows for p in range(a, b)])
        k, v = (torch.cat([data[r][1][t][a:b] for r, a, b in rows]) for t in (0, 1))
        write(view, torch.cat([slots, torch.tensor([-1])]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]]),
              transposed=kernel_window is None)
        row_class = None if gate is not None else torch.cat([data[r][2][a:b] for r, a, b in rows] + [gate_pad()])
        out = torch.full((q.shape[0] + 1, HEADS, d), 7.0)
        used = table[[r for r, _, _ in rows]]
        extra = ()
        if latent is not None:
            c = torch.cat([data[r][3][a:b] for r, a, b in rows])
            lslots = [int(latent_table[r, p // BS_LATENT]) * BS_LATENT + p % BS_LATENT for r, a, b in rows
                      for p in range(a, b)]
            write_latents(latent_cache, torch.tensor(lslots + [-1]), torch.cat([c, c[:1]]))
            extra = far_pieces(q, latent_cache, torch.tensor(starts), torch.tensor(lens),
                               latent_table[[r for r, _, _ in rows]], latent[1], latent[0], SCALE, budget=latent[2])
        if kernel_window is not None:
            aha_paged(torch.cat([q, q[:1]]), view, torch.tensor(starts), torch.tensor(lens), used, row_class,
                      kernel_window, d ** -0.5, out)
        else:
            if positions is not None:
                options["positions"] = positions(PagedStepPlan(torch.tensor(starts), torch.tensor(lens), used,
                                                               q.shape[0]))
            dispatch("paged", torch.cat([q, q[:1]]), view, torch.tensor(starts), torch.tensor(lens), used, reads,
                     d ** -0.5, out, row_class=row_class, q_tile=q_tile, extra=extra, backend=path, **options)
        assert bool((out[-1] == 7.0).all())  # the padding row is left alone
        for (r, a, b), s0, s1 in zip(rows, starts, starts[1:]):
            outs[r][a:b] = out[s0:s1]
    assert done == lengths
    return outs, data


def gate_pad():
    return torch.ones(1, HEADS, dtype=torch.bool)


def _bhld(x):
    return x.transpose(0, 1)[None]


def _check(outs, data, want_fn):
    for r, (out, d) in enumerate(zip(outs, data)):
        want = want_fn(*d)
        first = SHARED if r == 3 else 0
        torch.testing.assert_close(out[first:], want[first:], atol=1e-5, rtol=1e-5)


PATTERNS = [ah.SinksConfig(window=5, n_sinks=2), ah.DilatedConfig(window=4, dilation=(1, 2, 1, 3)),
            ah.LongformerConfig(window=3, global_first=2, global_positions=(11,)),
            ah.BigBirdConfig(block=2, window_blocks=2, global_blocks=1, random_blocks=1)]


@pytest.mark.parametrize("path", ["torch", "reference"])
@pytest.mark.parametrize("cfg", PATTERNS, ids=lambda c: c.kind)
def test_masked_patterns_equal_dense_reference(cfg, path):
    gen = torch.Generator().manual_seed(0)
    pred = registry.from_dict(registry.to_dict(cfg)).mask_fn(None)
    outs, data = _serve([[(pred, 0)]], gen, gate=False, path=path)
    _check(outs, data, lambda q, kv, g, c: pattern_attention_reference(_bhld(q), _bhld(kv[0]), _bhld(kv[1]), pred,
                                                            scale=SCALE)[0].transpose(0, 1))


AHA_READS = [[window_read(6)], [causal_read()]]  # with their dense tests


@pytest.mark.parametrize("tiles", [(4, 8, False), (64, 1, False), (1, 2, False), (4, 0, False), (4, 8, True)],
                         ids=["tile4-pack8", "tile64", "tile1-pack2", "no-dense-tests", "tile4-pack8-folded"])
def test_aha_equals_reference(tiles, monkeypatch):
    """Per (token, head) the window (class 0) or every earlier key (class 1), whatever the tile sizes, the
    chunks read entirely found by the reads' dense tests or by evaluating their predicates; "folded": the
    pieces merged two at a time as they come (a merge budget of 0 bytes)."""
    gen = torch.Generator().manual_seed(1)
    q_tile, pack, folded = tiles
    if folded:
        monkeypatch.setattr(paged_chunks, "MERGE_BUDGET", 0)
    no_dense = [[(replace(sliding_window(6), dense=None), 0)], [(replace(causal, dense=None), 0)]]
    reads = AHA_READS if pack else no_dense
    outs, data = _serve(reads, gen, q_tile=q_tile, pack=pack or 4)
    _check(outs, data, lambda q, kv, g, c: aha_attention_reference(_bhld(q), _bhld(kv[0]), _bhld(kv[1]),
                                                            g.T[None], 6, SCALE)[0].transpose(0, 1))


@pytest.mark.parametrize("path", ["torch", "reference"])
def test_the_step_plans_positions_are_read(path):
    """A step plan's token positions, handed to the op (as the served layer does), give the reference; positions
    shifted by one give something else (so they are read, not made again); positions of another step's length
    are not taken."""
    def shifted(plan):
        req, pos = plan.token_positions()
        return req, (pos - 1).clamp_min(0)

    def want(q, kv, g, c):
        return aha_attention_reference(_bhld(q), _bhld(kv[0]), _bhld(kv[1]), g.T[None], 6, SCALE)[0].transpose(0, 1)

    for given in (PagedStepPlan.token_positions, lambda plan: tuple(t[:-1] for t in shifted(plan))):
        outs, data = _serve(AHA_READS, torch.Generator().manual_seed(1), path=path, positions=given)
        _check(outs, data, want)
    outs, data = _serve(AHA_READS, torch.Generator().manual_seed(1), path=path, positions=shifted)
    with pytest.raises(AssertionError):
        _check(outs, data, want)


def test_aha_through_the_triton_paged_kernel():
    """The path of a served AHA layer on CUDA (here under Triton's interpreter), on the same steps: chunked
    prefill beside decodes, a prefix-cache hit, padding slots and rows; keys stored untransposed."""
    pytest.importorskip("triton")  # on the CPU, conftest.py has chosen Triton's interpreter
    assert kernel_refusal(16, torch.device("cuda")) is None
    assert "head dim 8" in kernel_refusal(8, torch.device("cuda"))
    assert "soft-capped" in kernel_refusal(16, torch.device("cuda"), softcap=30.0)
    gen = torch.Generator().manual_seed(1)
    outs, data = _serve(None, gen, d=16, kernel_window=6)
    _check(outs, data, lambda q, kv, g, c: aha_attention_reference(_bhld(q), _bhld(kv[0]), _bhld(kv[1]),
                                                            g.T[None], 6, 16 ** -0.5)[0].transpose(0, 1))


def _dense_terms(sinks=None, cap=0.0):
    """A dense ``attend`` with the host's softmax terms: learned sink logits, soft-capped scores."""
    def attend(q, k, v, allowed):
        rep = q.shape[1] // k.shape[1]
        s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * SCALE
        if cap:
            s = torch.tanh(s / cap) * cap
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
        p = torch.softmax(s, -1)[..., : k.shape[2]]
        return p.nan_to_num(0.0) @ v.repeat_interleave(rep, 1)
    return attend


@pytest.mark.parametrize("path", ["torch", "reference"])
@pytest.mark.parametrize("terms", [{"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}, {"softcap": 0.7}],
                         ids=["sink-logits", "softcap"])
def test_aha_with_host_softmax_terms(terms, path):
    gen = torch.Generator().manual_seed(2)
    outs, data = _serve(AHA_READS, gen, path=path, **terms)
    attend = _dense_terms(terms.get("sinks"), terms.get("softcap", 0.0))
    _check(outs, data, lambda q, kv, g, c: aha_attention_reference(
        _bhld(q), _bhld(kv[0]), _bhld(kv[1]), g.T[None], 6, SCALE, attend=attend)[0].transpose(0, 1))


def test_class_without_reads_keeps_out():
    """AHA's local rows computed elsewhere (vLLM's windowed kernel): the rows of a class that reads nothing keep
    what ``out`` held; the others are written."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, HEADS, D, generator=gen)
    k, v = torch.randn(6, KV_HEADS, D, generator=gen), torch.randn(6, KV_HEADS, D, generator=gen)
    view = paged_view(torch.zeros(3, KV_HEADS, BS, 2 * D), BS, KV_HEADS, D)
    write(view, torch.tensor([8, 9, 10, 11, 0, 1]), k, v)
    gate = torch.rand(6, HEADS, generator=gen) < 0.5
    out = torch.full((6, HEADS, D), 7.0)
    paged_attention(q, view, torch.tensor([0, 6]), torch.tensor([6]), torch.tensor([[2, 0]]), [[], [causal_read()]],
                    SCALE, out, row_class=gate)
    want = aha_attention_reference(_bhld(q), _bhld(k), _bhld(v), gate.T[None], 1, SCALE)[0].transpose(0, 1)
    torch.testing.assert_close(out[gate], want[gate], atol=1e-5, rtol=1e-5)
    assert bool((out[~gate] == 7.0).all())


def test_matmul_path_equals_reference(monkeypatch):
    """Scores by matmul (soft-capped layers; devices without the CPU's fused kernel) instead of the fused kernel."""
    import allhere.ops.paged.chunks as chunks

    monkeypatch.setattr(chunks, "FUSED", False)
    gen = torch.Generator().manual_seed(4)
    outs, data = _serve(AHA_READS, gen)
    _check(outs, data, lambda q, kv, g, c: aha_attention_reference(_bhld(q), _bhld(kv[0]), _bhld(kv[1]),
                                                            g.T[None], 6, SCALE)[0].transpose(0, 1))


def _latent_kv(gen, bias: bool, neox: bool, norm: bool):
    """Far keys made as a host block makes them (``rotary_projection``): a linear map of the latent (with a bias
    or not), a per-head norm or not, a rotation of the first ROTATED dimensions by the token's position, in
    GPT-NeoX's pairs (i, i + ROTATED / 2) or GPT-J's (2i, 2i + 1); far values a linear map. Returns (LatentKV,
    the far keys [tokens, kv heads, d] of latents [tokens, D_DOWN] computed directly)."""
    w_k = torch.randn(KV_HEADS * D, D_DOWN, generator=gen)
    b_k = torch.randn(KV_HEADS * D, generator=gen) if bias else None
    angle = torch.arange(64)[:, None] * torch.rand(ROTATED // 2, generator=gen)
    scale = torch.rand(D, generator=gen) + 0.5

    def head_norm(x):
        return x / x.norm(dim=-1, keepdim=True) * scale

    def direct(c, positions):
        k = (c @ w_k.T + (0 if b_k is None else b_k)).view(-1, KV_HEADS, D)
        k = head_norm(k) if norm else k
        rot, rest = k[..., :ROTATED], k[..., ROTATED:]
        a, b = (rot[..., : ROTATED // 2], rot[..., ROTATED // 2:]) if neox else (rot[..., 0::2], rot[..., 1::2])
        cos, sin = angle[positions].cos()[:, None], angle[positions].sin()[:, None]
        a, b = a * cos - b * sin, b * cos + a * sin
        rot = torch.cat([a, b], -1) if neox else torch.stack([a, b], -1).flatten(-2)
        return torch.cat([rot, rest], -1)

    keys, order = rotary_projection(w_k, b_k, KV_HEADS, (torch.polar(torch.ones_like(angle), angle), neox),
                                    head_norm if norm else None)
    v_bias = torch.randn(KV_HEADS, D, generator=gen) if bias else None
    return LatentKV(keys, torch.randn(KV_HEADS, D, D_DOWN, generator=gen), v_bias, order), direct


@pytest.mark.parametrize("window,bias,neox,norm,budget,fused,folded", [
    (0, False, True, False, SMALL_BUDGET, True, False), (3, True, True, False, SMALL_BUDGET, False, False),
    (3, False, False, True, 1 << 20, True, False), (20, False, True, True, SMALL_BUDGET, True, True),
    (8, True, False, False, 1 << 20, False, False)])
def test_dar_latents_equal_reference(window, bias, neox, norm, budget, fused, folded, monkeypatch):
    """DAR as served: the near window from the paged K/V, the far keys rebuilt from a paged latent cache of
    its own (other blocks, another block size, a strided view), one softmax = the dense reference with the
    far K/V made from the latents directly. A small budget: keys in pieces of 8, one decode request per piece,
    a prefill's keys read by all its queries in several chunks; a large one: the decode requests of a step in
    one piece, the narrower ones masked. A prefill's far keys through torch's fused attention ("fused") or by
    matmuls (as on other devices); "folded": merged two pieces at a time as they come."""
    monkeypatch.setattr(paged_chunks, "FUSED", fused)
    if folded:
        monkeypatch.setattr(paged_chunks, "MERGE_BUDGET", 0)
    gen = torch.Generator().manual_seed(3)
    kv, direct = _latent_kv(gen, bias, neox, norm)
    reads = [[window_read(window)] if window else []]
    outs, data = _serve(reads, gen, gate=False, latent=(kv, window, budget))

    def want(q, near, g, c):
        k_far = direct(c, torch.arange(c.shape[0]))
        v_far = torch.einsum("hdc,tc->thd", kv.v_weight, c) + (0 if kv.v_bias is None else kv.v_bias)
        return dar_attention_reference(_bhld(q), *(_bhld(t) for t in (*near, k_far, v_far)), window,
                                       scale=SCALE)[0].transpose(0, 1)

    _check(outs, data, want)


def test_dar_latents_on_the_reference_path():
    """The reference path of op family "paged" with DAR's far pieces joined (``extra``): the same as the dense
    reference of DAR."""
    gen = torch.Generator().manual_seed(3)
    kv, direct = _latent_kv(gen, True, True, False)
    outs, data = _serve([[window_read(3)]], gen, gate=False, latent=(kv, 3, SMALL_BUDGET), path="reference")

    def want(q, near, g, c):
        k_far = direct(c, torch.arange(c.shape[0]))
        v_far = torch.einsum("hdc,tc->thd", kv.v_weight, c) + kv.v_bias
        return dar_attention_reference(_bhld(q), *(_bhld(t) for t in (*near, k_far, v_far)), 3,
                                       scale=SCALE)[0].transpose(0, 1)

    _check(outs, data, want)


def test_paged_paths_as_the_backend_picks_them():
    """Op family "paged" in ``allhere.backend``: "auto" takes the torch path on the CPU, ``use_backend`` reaches
    it, the Triton path refuses what is not AHA's two classes, and the reference reads either key layout."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(6, HEADS, 16, generator=gen)
    k, v = torch.randn(6, KV_HEADS, 16, generator=gen), torch.randn(6, KV_HEADS, 16, generator=gen)
    gate = torch.rand(6, HEADS, generator=gen) < 0.5
    args = (q, None, torch.tensor([0, 6]), torch.tensor([6]), torch.tensor([[2, 0]]), AHA_READS, SCALE, None)
    assert select("paged", *args, row_class=gate, window_class=0).backend == "torch"
    with ah.use_backend("reference"):
        assert select("paged", *args, row_class=gate, window_class=0).backend == "reference"
    with pytest.raises(ValueError, match="two row classes"):
        select("paged", *args, backend="triton")
    want = aha_attention_reference(_bhld(q), _bhld(k), _bhld(v), gate.T[None], 6, SCALE)[0].transpose(0, 1)
    for transposed in (True, False):
        view = paged_view(torch.zeros(3, KV_HEADS, BS, 2 * 16), BS, KV_HEADS, 16)
        write(view, torch.tensor([8, 9, 10, 11, 0, 1]), k, v, transposed=transposed)
        out = torch.empty(6, HEADS, 16)
        dispatch("paged", q, view, *args[2:6], SCALE, out, row_class=gate, window_class=0, transposed=transposed,
                 backend="reference")
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_dar_prefill_in_half_precision():
    """A bf16 prefill (queries, latents and weights in bf16): the far keys are rebuilt in float32 and read in
    the queries' dtype by the fused path; close to the float32 result."""
    gen = torch.Generator().manual_seed(5)
    kv, _ = _latent_kv(gen, True, True, False)
    n, window = 24, 3
    q, c = torch.randn(n, HEADS, D, generator=gen), torch.randn(n, D_DOWN, generator=gen)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        view = torch.zeros(4, BS_LATENT, D_DOWN, dtype=dtype)
        write_latents(view, torch.arange(n), c.to(dtype))
        pieces = far_pieces(q.to(dtype), view, torch.tensor([0, n]), torch.tensor([n]), torch.tensor([[2, 0, 3]]),
                            window, kv, SCALE)
        outs.append(merge_pieces(list(pieces), n * HEADS, D, q.device)[0])
    assert outs[1].dtype == torch.float32 and not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], atol=0.1, rtol=0.05)  # bf16 inputs: about 3 digits


def test_view_refuses_partial_blocks():
    with pytest.raises(ValueError, match="whole blocks"):
        paged_view(torch.zeros(10), BS, KV_HEADS, D)


def test_step_plan_makes_each_part_once():
    """A step's plan makes each part at the first layer that asks and hands the same object to the others; its
    token positions and slot places are ``token_positions`` and ``slot_places`` of the step."""
    starts, lens = torch.tensor([0, 3, 4, 5], dtype=torch.int32), torch.tensor([7, 2, 9], dtype=torch.int32)
    table = torch.tensor([[4, 1], [0, 0], [2, 3]], dtype=torch.int32)
    slots = torch.tensor([4 * BS + 1, 4 * BS + 2, 4 * BS + 3, -1, 3 * BS])
    plan = PagedStepPlan(starts, lens, table, 5)
    calls = []
    assert plan.part("x", lambda: calls.append(1) or len(calls)) == 1
    assert plan.part("x", lambda: calls.append(1) or len(calls)) == 1 and calls == [1]
    req, pos = plan.token_positions()
    assert plan.token_positions()[0] is req
    want = token_positions(starts, lens, 5)
    assert torch.equal(req, want[0]) and torch.equal(pos, want[1]) and not plan.decodes_only()
    kept, blocks, rows = plan.slot_places(slots, BS)
    assert plan.slot_places(slots, BS)[1] is blocks
    assert kept.tolist() == [0, 1, 2, 4] and blocks.tolist() == [4, 4, 4, 3] and rows.tolist() == [1, 2, 3, 0]
    assert PagedStepPlan(torch.arange(4), lens, table, 3).decodes_only()


def latent_decode_case(window: int, dtype: torch.dtype):
    """A dar_latent decode step over paged caches (requests of LENGTHS tokens, each decoding its last): returns
    (the arguments of ``dar_latent_decode.decode_latent`` but ``out``, the expected output by
    ``dar_latent_attention_reference`` per request in fp32, and (the far queries, W_UK, e_r)). Unwritten row
    slots hold 1e4 (weight 0, finite); the rows' pages are padded as vLLM pads them."""
    from allhere.ops.dar_latent import dar_latent_attention_reference

    gen = torch.Generator().manual_seed(5)
    d_c, e_r = 5, 2
    width = d_c + KV_HEADS * e_r
    (table, pool), (rows_table, rows_pool) = _table(gen, BS), _table(gen, BS_LATENT)
    table, rows_table = table.clamp_min(0), rows_table.clamp_min(0)  # past a request's blocks: 0, as vLLM's
    view = paged_view(torch.zeros(pool, KV_HEADS, BS, 2 * D, dtype=dtype), BS, KV_HEADS, D)
    # pages padded by a fraction of a row, as vLLM pads a cache group's page to another group's size
    rows = torch.full((rows_pool, BS_LATENT * width + 5), 1e4, dtype=dtype)[:, :BS_LATENT * width]
    rows = rows.view(rows_pool, BS_LATENT, width)
    w_uk, w_uv = torch.randn(KV_HEADS, D - e_r, d_c, generator=gen), torch.randn(KV_HEADS, D, d_c, generator=gen)
    data = []
    for r, n in enumerate(LENGTHS):
        k, v = (torch.randn(n, KV_HEADS, D, generator=gen).to(dtype) for _ in range(2))
        c = torch.randn(n, width, generator=gen).to(dtype)
        write(view, torch.tensor([int(table[r, p // BS]) * BS + p % BS for p in range(n)]), k, v)
        write_latents(rows, torch.tensor([int(rows_table[r, p // BS_LATENT]) * BS_LATENT + p % BS_LATENT
                                          for p in range(n)]), c)
        data.append((k, v, c))
    m = len(LENGTHS)
    q, q_far = (torch.randn(m, HEADS, D, generator=gen).to(dtype) for _ in range(2))
    want = torch.cat([dar_latent_attention_reference(q[r][None, :, None], q_far[r][None, :, None], _bhld(k), _bhld(v),
                                                     c[None], w_uk, w_uv, window, SCALE)[0, :, 0][None]
                      for r, (k, v, c) in enumerate(data)]).float()
    pos = torch.tensor(LENGTHS) - 1
    q_row = query_rows(q_far.view(m, KV_HEADS, -1, D), w_uk, e_r, dtype).view(m, HEADS, -1)
    return (q, q_row, pos, view, table[:m], rows, rows_table[:m], window, w_uv, SCALE), want, e_r


@pytest.mark.parametrize("window", [0, 1, 3, 6, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("piece", [4 << 20, 1], ids=["one_piece", "a_request_a_piece"])
def test_dar_latent_decode_step(window, dtype, piece, monkeypatch):
    """dar_latent's decode step as served, both ways: all requests at once into ``out`` (``dar_latent_decode``:
    the far rows gathered for all requests in one piece, or request by request), and the window through op family
    "paged" with the far rows read absorbed as pieces (``far_pieces`` with ``absorbed``, as a step with a prefill
    serves its decode rows), each = ``dar_latent_attention_reference`` per request (window from the paged K/V, far
    keys from the paged rows [c ; k^R], other blocks and another block size). (vLLM's kernel for the far rows:
    tests/serve/test_serve_vllm.py.)"""
    from allhere.ops.paged import dar_latent_decode

    monkeypatch.setattr(dar_latent_decode, "PIECE_BYTES", piece)
    monkeypatch.setattr(dar_latent_decode, "USE_KERNEL", False)
    args, want, e_r = latent_decode_case(window, dtype)
    q, q_row, pos, view, table, rows, rows_table, _, w_uv, _ = args
    m = len(LENGTHS)
    direct, again = (torch.full((m, HEADS, D), 7.0, dtype=dtype) for _ in range(2))
    starts, lens = torch.arange(m + 1), torch.tensor(LENGTHS)
    step = PagedStepPlan(starts, lens, table, m)  # a second layer of the step reads what the first kept
    dar_latent_decode.decode_latent(*args, direct, plan=step)
    dar_latent_decode.decode_latent(*args, again, plan=step)
    assert step.parts
    kv = LatentKV(None, w_uv)
    read = []  # the token ids whose rows the pieces asked for
    pieces = far_pieces(q.new_full((m, HEADS, D), float("nan")), rows, starts, lens, rows_table, window, kv, SCALE,
                        absorbed=lambda ids: read.append(ids) or q_row[ids])
    merged = torch.full((m, HEADS, D), 7.0, dtype=dtype)
    dispatch("paged", q, view, starts, lens, table, [[window_read(window)] if window else []], SCALE, merged,
             extra=pieces, backend="torch")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got in (direct, again, merged):
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    readers = ((torch.tensor(LENGTHS) - window) > 0).nonzero().flatten().tolist()
    assert sorted(i for ids in read for i in ids.tolist()) == readers  # each far reader's row, asked for once


def _prefill_cache(gen, lens, blocks: int, kv_heads: int, d: int, dtype, bs: int = 32):
    """A paged cache of ``len(lens)`` requests' random K/V (request r: ``lens[r]`` tokens, at most ``blocks``
    blocks of ``bs``), their blocks scattered: (view, table [requests, blocks], per request (k, v) in float32 as
    the cache holds them)."""
    pool = len(lens) * blocks
    view = paged_view(torch.zeros(pool, kv_heads, bs, 2 * d, dtype=dtype), bs, kv_heads, d)
    table = torch.randperm(pool, generator=gen).to(torch.int32).view(len(lens), blocks)
    dense = []
    for r, n in enumerate(lens):
        k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
        write(view, torch.tensor([int(table[r, p // bs]) * bs + p % bs for p in range(n)]), k, v)
        dense.append((k.to(dtype).float(), v.to(dtype).float()))
    return view, table, dense


@pytest.mark.parametrize("window, n_sinks, dtype, small", [(40, 0, torch.float32, False),
                                                            (40, 1, torch.float32, False),
                                                            (40, 2, torch.float32, False),
                                                            (200, 1, torch.float32, False),
                                                            (40, 1, torch.bfloat16, False),
                                                            (40, 1, torch.float32, True)])
def test_aha_prefill_in_large_calls_equals_paged_attention(window, n_sinks, dtype, small, monkeypatch):
    """``aha_prefill.aha_prefill`` (AHA's prefill rows per request in a few calls of torch's fused attention)
    = ``paged_attention`` on every row it writes: a whole prompt, a later chunk of one (keys before the chunk,
    blocks scattered), a chunk shorter than a tile, a decode token beside them (not written); a window wider than
    a tile; with and without sinks; ``small``: tiles of 48 and global rows 16 to a call (many of each)."""
    from allhere.ops.paged import aha_prefill as prefill_module
    from allhere.ops.paged.aha_prefill import aha_prefill

    if small:
        monkeypatch.setattr(prefill_module, "TILE", 48)
        monkeypatch.setattr(prefill_module, "GLOBAL_ROWS", 16)

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 6, 2, 16
    lens, q_lens = [300, 77, 130, 20], [250, 1, 130, 20]
    view, table, _ = _prefill_cache(gen, lens, 10, kv_heads, d, dtype)
    q = torch.randn(sum(q_lens), heads, d, generator=gen).to(dtype)
    starts, seq_lens = torch.tensor([0, 250, 251, 381, 401], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    glob = torch.rand(q.shape[0], heads, generator=gen) < 0.2
    ref = torch.zeros_like(q)
    paged_attention(q, view, starts, seq_lens, table, [[window_read(window, n_sinks=n_sinks)], [causal_read()]],
                    d ** -0.5, ref, row_class=glob)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    ours = torch.full_like(q, 7.0)
    done = aha_prefill(q, view, starts, seq_lens, table, ~glob, window, n_sinks, d ** -0.5, ours)
    assert done.tolist() == [True] * 250 + [False] + [True] * 150
    torch.testing.assert_close(ours[done].float(), ref[done].float(), **tol)
    assert bool((ours[~done] == 7.0).all())  # the decode token's rows are left as they were


@pytest.mark.parametrize("window, dtype, small", [(40, torch.float32, False), (200, torch.float32, False),
                                                   (40, torch.bfloat16, False), (40, torch.float32, True)])
def test_window_prefill_pieces_equal_the_window_rows(window, dtype, small, monkeypatch):
    """``window_prefill.window_pieces`` (a prefill's windows in a few fused calls, as pieces with their
    log-sum-exp) = ``paged_attention``'s window rows, and each row's log-sum-exp = the dense one: a whole prompt,
    a later chunk whose first blocks were freed (filled with NaN, as nothing reads there), a chunk shorter than a
    tile, a decode token beside them (no piece); a window wider than a tile; ``small``: tiles of 48."""
    from allhere.ops.paged import aha_prefill as prefill_module
    from allhere.ops.paged.window_prefill import window_pieces

    if small:
        monkeypatch.setattr(prefill_module, "TILE", 48)
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, d, bs = 6, 2, 16, 32
    lens, q_lens = [300, 77, 530, 20], [250, 1, 130, 20]
    view, table, dense = _prefill_cache(gen, lens, 20, kv_heads, d, dtype)
    q = torch.randn(sum(q_lens), heads, d, generator=gen).to(dtype)
    starts, seq_lens = torch.tensor([0, 250, 251, 381, 401], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    ref = torch.zeros_like(q)
    paged_attention(q, view, starts, seq_lens, table, [[window_read(window)]], d ** -0.5, ref)
    reach = (lens[2] - q_lens[2] - window) // bs  # request 2: the blocks behind every window
    view[table[2, :reach].long()] = float("nan")
    pieces = list(window_pieces(q, view, starts, seq_lens, table, window, d ** -0.5))
    assert len(pieces) == 3  # not the decode token
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    group = heads // kv_heads
    for (ids, o, lse), r in zip(pieces, (0, 2, 3)):
        s, t = int(starts[r]), q_lens[r]
        assert ids[0].tolist() == list(range(s * heads, (s + t) * heads))
        torch.testing.assert_close(o[0].view(t, heads, d).float(), ref[s:s + t].float(), **tol)
        k, v = dense[r]
        pos = torch.arange(lens[r] - t, lens[r])
        allowed = (torch.arange(lens[r])[None] <= pos[:, None]) & (pos[:, None] - torch.arange(lens[r])[None] < window)
        scores = torch.einsum("thd,khd->thk", q[s:s + t].float(), k.repeat_interleave(group, 1)) * d ** -0.5
        want = scores.masked_fill(~allowed[:, None], float("-inf")).logsumexp(-1)
        torch.testing.assert_close(lse[0].view(t, heads), want, **tol)


def test_decode_reads_kept_for_the_steps_other_layers():
    """A decode step of a one-rule layer (``decode_direct``) with the step's plan: the first layer works out which
    blocks and keys its rows read, a second layer of the same rule (another cache, other queries) reuses them and
    gets what it gets with no plan, and a layer of another rule works out its own."""
    gen = torch.Generator().manual_seed(3)
    starts = torch.arange(len(LENGTHS) + 1, dtype=torch.int32)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    table, pool = _table(gen, BS)
    table = table[:len(LENGTHS)].clamp_min(0)
    bigbird = ah.BigBirdConfig(block=4, window_blocks=2, global_blocks=1, random_blocks=1).mask_fn(None)
    plan = PagedStepPlan(starts, lens, table, len(LENGTHS))
    for pred in (bigbird, bigbird, sliding_window(5)):
        view = paged_view(torch.randn(pool, KV_HEADS, BS, 2 * D, generator=gen), BS, KV_HEADS, D)
        q = torch.randn(len(LENGTHS), HEADS, D, generator=gen)
        alone, planned = torch.zeros_like(q), torch.zeros_like(q)
        paged_attention(q, view, starts, lens, table, [[Read(pred)]], SCALE, alone)
        paged_attention(q, view, starts, lens, table, [[Read(pred)]], SCALE, planned, plan=plan)
        torch.testing.assert_close(planned, alone, atol=0, rtol=0)
        assert bool(alone.abs().sum(-1).gt(0).all())
    assert sorted(k[1].name for k in plan.parts if k[0] == "direct reads") == sorted([bigbird.name, "sliding_window_5"])
