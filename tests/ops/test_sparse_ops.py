"""The fast paths of the sparse patterns against their dense reference (masked_attention under dense_mask of
the same predicate), outputs and gradients; and the dense reference against a brute-force loop."""

import math

import pytest
import torch

from allhere.masks import (
    and_masks,
    bigbird,
    causal,
    dense_mask,
    dilated_window,
    global_tokens,
    longformer,
    sinks,
    sliding_window,
    sliding_with_sinks,
    within_segments,
)
from allhere.ops.blocksparse import (
    blocksparse_attention,
    pattern_attention,
    plan_blocks,
)
from allhere.ops.dilated import dilated_window_attention
from allhere.ops.full import pattern_attention_reference

FLAGS = torch.zeros(2, 64, dtype=torch.bool)
FLAGS[0, [0, 17, 40]] = True
FLAGS[1, 5] = True

PATTERNS = {
    "window": sliding_window(9),
    "window_bidir": sliding_window(9, causal=False),
    "sinks": sliding_with_sinks(7, 3),
    "sinks_bidir": sliding_with_sinks(7, 3, causal=False),
    "dilated_heads": dilated_window(4, (1, 3, 2, 5)),
    "dilated_bidir": dilated_window(4, 3, causal=False),
    "longformer": longformer(5, FLAGS, dilation=2),
    "longformer_bidir": longformer(5, FLAGS[0], causal=False),
    "bigbird": bigbird(8, 2, 1, 2, seed=1),
    "bigbird_bidir": bigbird(8, 2, 1, 1, seed=1, causal=False, length=64),
    "no_tiles_rule": and_masks(causal, lambda b, h, q, k: (q - k) % 5 < 2),  # the chunked full evaluation
    "empty_rows": sinks(0),  # every query sees nothing: output 0
}


def qkv(lq, lk, heads=4, kv_heads=2, d=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, lq, d, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, lk, d, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, lk, d, generator=g, requires_grad=True)
    return q, k, v


def grads(out, inputs, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * w).sum(), inputs)


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("lq,lk,key_offset,block", [(64, 64, 0, 16), (64, 64, 0, 7), (13, 64, 0, 16), (1, 64, 0, 16),
                                                    (20, 50, 14, 8)])
def test_blocksparse_equals_dense_reference(name, lq, lk, key_offset, block):
    pred = PATTERNS[name]
    q, k, v = qkv(lq, lk)
    ref = pattern_attention_reference(q, k, v, pred, key_offset=key_offset)
    out = pattern_attention(q, k, v, pred, block=block, key_offset=key_offset)
    assert max_diff([out], [ref]) < 1e-5
    assert max_diff(grads(out, (q, k, v)), grads(ref, (q, k, v))) < 1e-5
    if name == "empty_rows":
        assert not out.any()


def test_plan_reuse_bucketing_and_work():
    n = 1024
    plan = plan_blocks(sliding_with_sinks(64, 4), n, n, heads=4, kv_heads=2, batch=1, block=32)
    # kept tiles: the window's 3 (2 for the first rows) plus the sink tile; far from the 32 x 33 / 2 causal tiles
    assert plan.kept_tiles <= 2 * 32 * 4 and plan.density < 0.15
    assert not plan.per_batch and not plan.per_head
    q, k, v = qkv(n, n, batch=1, d=8)
    with torch.no_grad():
        a = blocksparse_attention(q, k, v, plan)
        b = blocksparse_attention(q, k, v, plan, chunk_bytes=1)  # one row per SDPA call
        ref = pattern_attention_reference(q, k, v, sliding_with_sinks(64, 4))
    assert max_diff([a], [ref]) < 1e-5 and max_diff([b], [ref]) < 1e-5
    with pytest.raises(ValueError, match="the plan is for"):
        blocksparse_attention(q[:, :, 1:], k, v, plan)
    assert plan_blocks(dilated_window(4, (1, 2, 1, 2)), 64, 64, heads=4, kv_heads=2, block=16).per_head
    assert plan_blocks(global_tokens(FLAGS), 64, 64, batch=2, block=16).per_batch


def test_segments_with_blocksparse():
    starts = torch.tensor([[0] * 20 + [20] * 44, [-1] * 10 + [10] * 54])  # packed documents; left padding
    pred = and_masks(bigbird(8, 2, 1, 1, seed=0), within_segments(starts))
    q, k, v = qkv(64, 64)
    ref = pattern_attention_reference(q, k, v, pred)
    out = pattern_attention(q, k, v, pred, block=8)
    assert max_diff([out], [ref]) < 1e-5 and not out[1, :, :10].any()
    assert max_diff(grads(out, (q, k, v)), grads(ref, (q, k, v))) < 1e-5


@pytest.mark.parametrize("dilation,causal_", [(3, True), ((1, 3, 2, 3), True), ((2, 2, 4, 4), True), (3, False),
                                              ((1, 3, 2, 3), False)])
def test_dilated_op_equals_reference(dilation, causal_):
    q, k, v = qkv(61, 61)
    pred = dilated_window(5, dilation, causal=causal_)
    ref = pattern_attention_reference(q, k, v, pred)
    out = dilated_window_attention(q, k, v, 5, dilation, causal=causal_, block=16)
    assert max_diff([out], [ref]) < 1e-5
    assert max_diff(grads(out, (q, k, v)), grads(ref, (q, k, v))) < 1e-5


@pytest.mark.parametrize("name", list(PATTERNS))
def test_dense_reference_equals_brute_force_loop(name):
    """The reference itself: one (batch, head, query) at a time over the keys the predicate allows."""
    pred = PATTERNS[name]
    lq, lk, off = 9, 40, 3
    q, k, v = (t.detach().double() for t in qkv(lq, lk))
    out = pattern_attention_reference(q, k, v, pred, key_offset=off)
    g = q.shape[1] // k.shape[1]
    first = off + lk - lq
    for b in range(2):
        for h in range(4):
            for i in range(lq):
                keys = [j for j in range(lk) if bool(pred(torch.tensor(b), torch.tensor(h), torch.tensor(first + i),
                                                          torch.tensor(off + j)))]
                if not keys:
                    assert not out[b, h, i].any()
                    continue
                s = k[b, h // g, keys] @ q[b, h, i] / math.sqrt(q.shape[-1])
                want = torch.softmax(s, 0) @ v[b, h // g, keys]
                assert (out[b, h, i] - want).abs().max() < 1e-10


def test_dense_mask_grid_of_patterns():
    m = dense_mask(longformer(2, FLAGS), 64, 64, batch=2, heads=3)
    assert m.shape == (2, 3, 64, 64) and m[0, :, 40].all(-1).logical_not().all() and m[0, 0, 40, :41].all()
