"""The sparse pattern predicates (allhere.masks): each against a brute-force definition written with Python
loops, on grids with batch, heads, q_len < kv_len and key offsets; their rectangle rule (``tiles``); BigBird's
seeded random blocks."""

import random

import pytest
import torch

from allhere.masks import (
    and_masks,
    bigbird,
    bigbird_global,
    bigbird_random,
    bigbird_window,
    causal,
    dense_mask,
    dilated_window,
    global_at,
    global_first,
    global_from_ids,
    global_tokens,
    longformer,
    or_masks,
    sinks,
    sliding_window,
    sliding_with_sinks,
    within_segments,
)

B, H = 2, 3


def brute(rule, q_len, kv_len, key_offset=0):
    """bool [B, H, q_len, kv_len] from ``rule(b, h, q, k) -> bool`` on Python ints (queries: the last q_len)."""
    off = key_offset + kv_len - q_len
    return torch.tensor([[[[bool(rule(b, h, off + i, key_offset + j)) for j in range(kv_len)] for i in range(q_len)]
                          for h in range(H)] for b in range(B)])


def window_rule(w, causal):
    return lambda q, k: 0 <= q - k < w if causal else abs(q - k) < w


def dilated_rule(w, dil, causal):
    def rule(h, q, k):
        d = dil[h] if isinstance(dil, tuple) else dil
        diff = q - k if causal else abs(q - k)
        return diff >= 0 and diff % d == 0 and diff // d < w
    return rule


FLAGS = torch.zeros(B, 30, dtype=torch.bool)
FLAGS[0, [0, 7, 19]] = True
FLAGS[1, [3, 4]] = True
MANY = torch.arange(30) % 3 == 0  # 10 runs: more than global_tokens compares with, so looked up


def global_rule(flags, causal):
    def is_g(b, p):
        f = flags if flags.dim() == 1 else flags[b]
        return 0 <= p < f.numel() and bool(f[p])
    return lambda b, q, k: (is_g(b, q) or is_g(b, k)) and (k <= q or not causal)


def bigbird_rule(block, wb, gb, rb, seed, layer, causal, length):
    """BigBird from its definition: block window, global blocks, and the random draws re-done here."""
    def randoms(h, i, nb):
        if rb == 0 or i < gb:
            return set()
        if causal:
            pool, key = list(range(gb, i - wb + 1)), f"bigbird:{seed}:{layer}:{h}:{i}"
        else:
            pool, key = [j for j in range(gb, nb) if abs(i - j) >= wb], f"bigbird:{seed}:{layer}:{h}:{i}:{nb}"
        return set(random.Random(key).sample(pool, min(rb, len(pool))))

    nb = -(-length // block)

    def rule(h, q, k):
        i, j = q // block, k // block
        ok = (0 <= i - j < wb) if causal else abs(i - j) < wb
        ok = ok or i < gb or j < gb or j in randoms(h, i, nb)
        return ok and (k <= q or not causal)
    return rule


CASES = [  # (name, predicate, rule(b, h, q, k))
    ("window", sliding_window(4), lambda b, h, q, k: window_rule(4, True)(q, k)),
    ("window_bidir", sliding_window(4, causal=False), lambda b, h, q, k: window_rule(4, False)(q, k)),
    ("sinks", sinks(3), lambda b, h, q, k: k < 3 and k <= q),
    ("sinks_bidir", sinks(3, causal=False), lambda b, h, q, k: k < 3),
    ("window_sinks", sliding_with_sinks(4, 2), lambda b, h, q, k: (0 <= q - k < 4) or (k < 2 and k <= q)),
    ("window_sinks_bidir", sliding_with_sinks(4, 2, causal=False), lambda b, h, q, k: abs(q - k) < 4 or k < 2),
    ("dilated", dilated_window(3, 2), lambda b, h, q, k: dilated_rule(3, 2, True)(h, q, k)),
    ("dilated_heads", dilated_window(3, (1, 2, 4)), lambda b, h, q, k: dilated_rule(3, (1, 2, 4), True)(h, q, k)),
    ("dilated_bidir", dilated_window(3, (3, 1, 2), causal=False),
     lambda b, h, q, k: dilated_rule(3, (3, 1, 2), False)(h, q, k)),
    ("global", global_tokens(FLAGS), lambda b, h, q, k: global_rule(FLAGS, True)(b, q, k)),
    ("global_1d_bidir", global_tokens(FLAGS[0], causal=False),
     lambda b, h, q, k: global_rule(FLAGS[0], False)(b, q, k)),
    ("global_first", global_tokens(global_first(30, 5)),
     lambda b, h, q, k: global_rule(global_first(30, 5), True)(b, q, k)),
    ("global_many_runs", global_tokens(MANY), lambda b, h, q, k: global_rule(MANY, True)(b, q, k)),
    ("longformer", longformer(3, FLAGS, dilation=2),
     lambda b, h, q, k: dilated_rule(3, 2, True)(h, q, k) or global_rule(FLAGS, True)(b, q, k)),
    ("longformer_bidir", longformer(3, FLAGS[1], causal=False),
     lambda b, h, q, k: abs(q - k) < 3 or global_rule(FLAGS[1], False)(b, q, k)),
    ("bigbird", bigbird(3, 2, 1, 2, seed=5, layer=1),
     lambda b, h, q, k: bigbird_rule(3, 2, 1, 2, 5, 1, True, 30)(h, q, k)),
    ("bigbird_bidir", bigbird(3, 2, 1, 1, seed=2, causal=False, length=30),
     lambda b, h, q, k: bigbird_rule(3, 2, 1, 1, 2, 0, False, 30)(h, q, k)),
]


@pytest.mark.parametrize("name,pred,rule", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("q_len,kv_len,key_offset", [(30, 30, 0), (7, 30, 0), (1, 30, 0), (11, 24, 6)])
def test_predicate_equals_its_definition(name, pred, rule, q_len, kv_len, key_offset):
    got = dense_mask(pred, q_len, kv_len, batch=B, heads=H, key_offset=key_offset)
    want = brute(rule, q_len, kv_len, key_offset)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name,pred,rule", CASES, ids=[c[0] for c in CASES])
def test_tiles_never_miss_an_allowed_entry(name, pred, rule):
    """The rectangle rule the block-sparse op relies on: True wherever the rectangle holds an allowed entry
    (for these patterns also exact: False wherever it holds none)."""
    n = 30
    m = dense_mask(pred, n, n, batch=B, heads=H)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        ql, qh = sorted(torch.randint(0, n, (2,), generator=gen).tolist())
        kl, kh = sorted(torch.randint(0, n, (2,), generator=gen).tolist())
        t = pred.tiles(torch.arange(B).view(-1, 1), torch.arange(H).view(1, -1), *map(torch.tensor, (ql, qh, kl, kh)))
        want = m[:, :, ql:qh + 1, kl:kh + 1].flatten(2).any(-1)
        assert torch.equal(t.expand(B, H), want), (ql, qh, kl, kh)


def test_window_definition_and_encoder_window():
    assert dense_mask(sliding_window(3), 6, 6)[0, 0, 4].nonzero().flatten().tolist() == [2, 3, 4]
    assert dense_mask(sliding_window(3, causal=False), 6, 6)[0, 0, 2].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert dense_mask(dilated_window(3, 2), 9, 9)[0, 0, 8].nonzero().flatten().tolist() == [4, 6, 8]  # span 5
    assert torch.equal(dense_mask(dilated_window(5, 1), 12, 12), dense_mask(sliding_window(5), 12, 12))
    assert not dense_mask(sinks(0), 5, 5).any()


def test_bigbird_prefix_reproducible_and_random_blocks_are_new():
    full = dense_mask(bigbird(4, 2, 1, 2, seed=3), 96, 96, heads=4)
    prefix = dense_mask(bigbird(4, 2, 1, 2, seed=3), 40, 40, heads=4)
    assert torch.equal(full[..., :40, :40], prefix)  # causal: a prefix has the whole sequence's pattern
    assert not torch.equal(full, dense_mask(bigbird(4, 2, 1, 2, seed=4), 96, 96, heads=4))
    assert not torch.equal(full, dense_mask(bigbird(4, 2, 1, 2, seed=3, layer=1), 96, 96, heads=4))
    assert not torch.equal(full[0, 0], full[0, 1])  # per-head draws
    r = dense_mask(bigbird_random(4, 2, 1, 2, seed=3), 96, 96, heads=4)[..., ::4, ::4]  # one entry per block pair
    covered = (dense_mask(bigbird_window(4, 2), 96, 96) | dense_mask(bigbird_global(4, 1), 96, 96))[..., ::4, ::4]
    assert not (r & covered).any()  # random blocks are drawn among the blocks not yet covered
    counts = r.sum(-1)[0, :, 1:]  # query blocks 1..23 draw min(2, #blocks in 1 .. i - 2)
    assert counts.tolist() == [[min(2, max(0, i - 2)) for i in range(1, 24)]] * 4
    assert torch.equal(r, dense_mask(bigbird_random(4, 2, 1, 2, seed=3), 96, 96, heads=4)[..., ::4, ::4])


def test_bigbird_encoder_length_and_errors():
    a = dense_mask(bigbird(4, 2, 1, 1, seed=0, causal=False), 64, 64, heads=2)  # length read off the grid
    b = dense_mask(bigbird(4, 2, 1, 1, seed=0, causal=False, length=64), 64, 64, heads=2)
    assert torch.equal(a, b) and a[0, 0, :4].all() and a[0, 0, :, :4].all()  # the global block, both ways
    for bad in (lambda: sliding_window(0), lambda: sinks(-1), lambda: dilated_window(2, 0),
                lambda: dilated_window(2, ()), lambda: bigbird(0, 1, 1, 1),
                lambda: global_tokens(torch.zeros(1, 2, 3, dtype=torch.bool))):
        with pytest.raises(ValueError):
            bad()


def test_global_helpers():
    assert global_first(5, 2).tolist() == [True, True, False, False, False]
    assert global_at(6, [1, 4, 9]).nonzero().flatten().tolist() == [1, 4]
    ids = torch.tensor([[5, 2, 7, 2], [2, 0, 0, 9]])
    assert global_from_ids(ids, [2, 9]).tolist() == [[False, True, False, True], [True, False, False, True]]
    m = dense_mask(longformer(1, global_from_ids(ids, [2])), 4, 4, batch=2)
    assert m[0, 0, 2].tolist() == [False, True, True, False] and m[1, 0, 2].tolist() == [True, False, True, False]
    assert m[0, 0, 3].all()  # a global query sees every earlier key


def test_prepare_is_passed_on_and_does_not_freeze_the_random_blocks():
    """``and_masks`` / ``or_masks`` keep their parts' ``prepare`` (FlexAttention draws BigBird's table
    before tracing); eager evaluation after a ``prepare`` still draws the blocks of longer sequences."""
    rand = bigbird(4, 2, 1, 1, seed=1)
    combined = and_masks(rand, within_segments(torch.zeros(1, 32, dtype=torch.long)))
    assert or_masks(causal, combined).prepare is not None and or_masks(causal, causal).prepare is None
    combined.prepare(1, 16, "cpu")
    assert torch.equal(dense_mask(rand, 32, 32), dense_mask(bigbird(4, 2, 1, 1, seed=1), 32, 32))
    from torch.nn.attention.flex_attention import create_block_mask

    with pytest.raises(RuntimeError, match="must be drawn before the mask is traced"):  # vmap reads no position
        create_block_mask(bigbird(4, 2, 1, 1, seed=2), 1, 1, 32, 32, device="cpu")


def traced_ops(pred) -> list:
    """The calls of the graph torch.compile traces of ``pred`` on index tensors, as FlexAttention's kernel
    evaluates it per score: (name, args), a tensor argument given by its dtype; a captured table shows as an
    indexing (getitem)."""
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    args = (torch.tensor(0), torch.tensor(1), torch.arange(8, dtype=torch.int32).view(-1, 1),
            torch.arange(8, dtype=torch.int32).view(1, -1))  # FlexAttention's positions are int32
    torch.compile(pred, backend=keep, fullgraph=True)(*args)
    torch._dynamo.reset()
    arg = lambda a: a.meta["example_value"].dtype if hasattr(a, "meta") else a  # noqa: E731
    return [(getattr(n.target, "__name__", str(n.target)), tuple(map(arg, n.args))) for n in graphs[0].graph.nodes
            if n.op == "call_function"]


@pytest.mark.parametrize("name,pred", [
    ("longformer, first 16 global", longformer(512, global_first(64, 16))),
    ("longformer, global positions", longformer(8, global_at(64, [0, 1, 2, 30, 40]), dilation=2)),
])
def test_global_tokens_read_no_table_per_score(name, pred):
    """Longformer's global tokens (a few runs of positions) are comparisons, not lookups of a captured table:
    FlexAttention evaluates the predicate for every score of a partly masked tile. On an H200 Longformer ran
    at 0.75x dense at 32k with a lookup of its flags, where sinks, of the same tiles, ran at 6.3x."""
    assert not any(name == "getitem" for name, _ in traced_ops(pred))


def test_many_global_runs_and_per_batch_flags_still_look_up():
    for pred in (global_tokens(MANY), global_tokens(FLAGS)):
        assert any(name == "getitem" for name, _ in traced_ops(pred))


@pytest.mark.parametrize("dilation", [(1, 2, 4, 8) * 2, 3, 1])
def test_dilated_windows_divide_in_32_bits(dilation):
    """A per-head stride is looked up as int32, so the predicate divides int32 positions by an int32 (an int64
    stride made every score of a partly masked tile a 64-bit division on a GPU); one stride is a constant,
    and a stride of 1 divides by nothing."""
    mods = [args for name, args in traced_ops(dilated_window(128, dilation)) if name == "mod"]
    assert all(d in (torch.int32, dilation) for _, d in mods) and (dilation != 1 or not mods), mods
