"""The mask type (allhere.masks.Mask): every factory returns one; its block tests keep their promise on random
rectangles (``tiles`` a superset of the predicate: never False where a rectangle holds an allowed entry;
``dense`` a subset: never True where it holds a masked one), for the factories alone and combined with
``and_masks`` / ``or_masks``; what the combinators pass on; a Mask goes wherever a predicate goes."""

from dataclasses import replace

import pytest
import torch

from allhere import masks
from allhere.masks import Mask, and_masks, as_mask, causal, dense_mask, or_masks, sinks, sliding_window
from allhere.mechanisms.dar import far_keys
from allhere.ops.dilated import _valid_keys

B, H, N = 2, 4, 40
FLAGS = torch.zeros(B, N, dtype=torch.bool)
FLAGS[0, [0, 9, 23]] = True
FLAGS[1, [3, 4, 30]] = True
MANY = torch.arange(N) % 3 == 0  # more runs than global_tokens compares with: its flags are looked up

FACTORIES = {
    "causal": causal,
    "window": sliding_window(5),
    "window_bidir": sliding_window(5, causal=False),
    "dilated": masks.dilated_window(3, 2),
    "dilated_heads": masks.dilated_window(4, (1, 2, 3, 5)),
    "dilated_bidir": masks.dilated_window(3, (3, 1, 2, 2), causal=False),
    "sinks": sinks(3),
    "sinks_bidir": sinks(3, causal=False),
    "window_sinks": masks.sliding_with_sinks(6, 2),
    "global": masks.global_tokens(FLAGS),
    "global_first_bidir": masks.global_tokens(masks.global_first(N, 4), causal=False),
    "global_many_runs": masks.global_tokens(MANY),
    "longformer": masks.longformer(4, FLAGS, dilation=2),
    "longformer_bidir": masks.longformer(3, masks.global_at(N, [1, 17]), causal=False),
    "bigbird_window": masks.bigbird_window(3, 2),
    "bigbird_global": masks.bigbird_global(3, 2, causal=False),
    "bigbird_random": masks.bigbird_random(3, 2, 1, 2, seed=1),
    "bigbird": masks.bigbird(4, 2, 1, 2, seed=5, layer=1),
    "bigbird_bidir": masks.bigbird(3, 2, 1, 1, seed=2, causal=False, length=N),
    "within_segments": masks.within_segments(torch.tensor([[0] * 15 + [15] * 25, [0] * 40])),
    "dilated_op_valid_keys": _valid_keys(25, 2),
    "dar_far": far_keys(6),
}
COMBINED = {
    "and(window, far)": and_masks(sliding_window(12), far_keys(4)),  # both exact: dense of the AND
    "or(window, far)": or_masks(sliding_window(4), far_keys(9)),  # both exact: dense of the OR, a subset
    "or(causal, window_bidir)": or_masks(causal, sliding_window(3, causal=False)),
    "and(window_bidir, valid_keys)": and_masks(sliding_window(6, causal=False), _valid_keys(30, 3)),
    "and(or(window, sinks), causal)": and_masks(or_masks(sliding_window(6, causal=False), sinks(2)), causal),
    "and(dilated_heads, global)": and_masks(masks.dilated_window(5, (1, 2, 2, 4)), masks.global_tokens(FLAGS)),
    "or(bigbird, window)": or_masks(masks.bigbird(2, 2, 1, 1, seed=3), sliding_window(7)),
    "and(window, segments)": and_masks(sliding_window(9), FACTORIES["within_segments"]),
    "or(window, plain)": or_masks(sliding_window(3), lambda b, h, q, k: k % 7 == 0),
}
CASES = {**FACTORIES, **COMBINED}


def rectangles(count: int, seed: int) -> torch.Tensor:
    """int64 [4, count]: (q_lo, q_hi, k_lo, k_hi) inclusive, in [0, N): a third anywhere, a third small ones
    near the diagonal (where window edges lie), a third of one query or one key."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, N, (2, count), generator=gen).sort(0).values
    k = torch.randint(0, N, (2, count), generator=gen).sort(0).values
    near = slice(count // 3, 2 * count // 3)
    q_lo = torch.randint(0, N, (count,), generator=gen)
    k_lo = (q_lo - torch.randint(-6, 14, (count,), generator=gen)).clamp(0, N - 1)
    q[0, near], k[0, near] = q_lo[near], k_lo[near]
    q[1, near] = (q_lo + torch.randint(0, 5, (count,), generator=gen)).clamp(max=N - 1)[near]
    k[1, near] = (k_lo + torch.randint(0, 5, (count,), generator=gen)).clamp(max=N - 1)[near]
    one = slice(2 * count // 3, count)
    q[1, one][::2] = q[0, one][::2]  # one query
    k[1, one][1::2] = k[0, one][1::2]  # one key
    return torch.cat([q, k])


def check_blocks(mask: Mask, count: int = 300, seed: int = 0) -> None:
    """AssertionError unless ``mask.tiles`` says True wherever a rectangle holds an allowed entry and
    ``mask.dense`` says True only where every entry of a rectangle is allowed (None: nothing to check), on
    ``count`` rectangles for every (batch row, head)."""
    m = dense_mask(mask, N, N, batch=B, heads=H)
    ql, qh, kl, kh = (r.view(1, 1, -1) for r in rectangles(count, seed))
    b, h = torch.arange(B).view(-1, 1, 1), torch.arange(H).view(1, -1, 1)
    some = torch.stack([m[:, :, a:c + 1, x:y + 1].flatten(2).any(-1)
                        for a, c, x, y in zip(ql.flatten(), qh.flatten(), kl.flatten(), kh.flatten())], -1)
    every = torch.stack([m[:, :, a:c + 1, x:y + 1].flatten(2).all(-1)
                         for a, c, x, y in zip(ql.flatten(), qh.flatten(), kl.flatten(), kh.flatten())], -1)
    if mask.tiles is not None:
        tiles = torch.as_tensor(mask.tiles(b, h, ql, qh, kl, kh)).expand(B, H, count)
        missed = some & ~tiles
        assert not missed.any(), f"tiles misses allowed entries at {missed.nonzero()[:3].tolist()}"
    if mask.dense is not None:
        dense = torch.as_tensor(mask.dense(b, h, ql, qh, kl, kh)).expand(B, H, count)
        wrong = dense & ~every
        assert not wrong.any(), f"dense claims masked entries at {wrong.nonzero()[:3].tolist()}"


@pytest.mark.parametrize("name", list(CASES))
def test_block_tests_keep_their_promise(name):
    mask = CASES[name]
    assert isinstance(mask, Mask)
    check_blocks(mask)


def test_the_check_can_fail():
    """Block tests that break their promise are caught: the window's exact ``dense`` given as its ``tiles``
    (a subset), its ``tiles`` as its ``dense`` (a superset), a combination claiming whole blocks it lacks."""
    window = sliding_window(5)
    with pytest.raises(AssertionError, match="tiles misses"):
        check_blocks(replace(window, tiles=window.dense))
    with pytest.raises(AssertionError, match="dense claims"):
        check_blocks(replace(window, dense=window.tiles))
    with pytest.raises(AssertionError, match="dense claims"):
        check_blocks(replace(and_masks(sinks(3), far_keys(2)), dense=lambda b, h, ql, qh, kl, kh: kl < 3))


def test_exact_tests_are_exact():
    """causal, the window and DAR's far keys have exact tests: ``tiles`` True only where some entry is
    allowed, ``dense`` True wherever all are (the ring skips exactly what they never read)."""
    z = torch.zeros((), dtype=torch.long)
    for mask in (causal, sliding_window(5), sliding_window(4, causal=False), far_keys(6)):
        m = dense_mask(mask, N, N)[0, 0]
        for rect in rectangles(200, 1).T:
            ql, qh, kl, kh = rect.tolist()
            block = m[ql:qh + 1, kl:kh + 1]
            assert bool(mask.tiles(z, z, *rect)) == bool(block.any()), (mask, ql, qh, kl, kh)
            assert bool(mask.dense(z, z, *rect)) == bool(block.all()), (mask, ql, qh, kl, kh)


def test_combinators_pass_everything_on():
    both = and_masks(sliding_window(4), causal)
    assert both.tiles is not None and both.dense is not None
    assert or_masks(sliding_window(4), far_keys(4)).dense is not None
    plain = lambda b, h, q, k: k == 0  # noqa: E731
    for combine in (and_masks, or_masks):  # a part without a test: the combination has none
        assert combine(sliding_window(4), sinks(2)).dense is None and combine(causal, sinks(2)).tiles is not None
        assert combine(causal, plain).tiles is None and combine(causal, plain).dense is None
    per_head = masks.dilated_window(3, (1, 2))
    assert per_head.per_head and per_head.prepare is not None
    combined = or_masks(causal, and_masks(per_head, masks.global_tokens(FLAGS)))
    assert combined.per_head and combined.prepare is not None
    assert not or_masks(causal, sinks(2)).per_head and or_masks(causal, sinks(2)).prepare is None


def test_as_mask_and_plain_functions():
    plain = lambda b, h, q, k: q >= k  # noqa: E731
    wrapped = as_mask(plain)
    assert wrapped.tiles is None and wrapped.dense is None and not wrapped.per_head and wrapped.prepare is None
    assert as_mask(causal) is causal and Mask(causal).pred is causal.pred  # a Mask is never a Mask's predicate
    assert torch.equal(dense_mask(wrapped, 9, 9), dense_mask(causal, 9, 9))
    with pytest.raises(TypeError, match="must be a Mask or a predicate"):
        as_mask(3)


@pytest.mark.parametrize("name", ["window_sinks", "dilated_heads", "longformer", "bigbird"])
def test_flex_takes_a_mask_as_it_is(name):
    """FlexAttention's create_block_mask vmaps a Mask as it vmaps its plain function: the same block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = FACTORIES[name]
    if mask.prepare is not None:
        mask.prepare(H, N, "cpu")
    got, want = (create_block_mask(m, B, H, N, N, device="cpu", BLOCK_SIZE=8) for m in (mask, mask.pred))
    for attr in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(got, attr), getattr(want, attr)), attr
    assert torch.equal(torch.vmap(mask, in_dims=(None, None, 0, None))(torch.tensor(0), torch.tensor(1),
                                                                       torch.arange(N), torch.arange(N)),
                       dense_mask(mask, N, N, heads=2)[0, 1])
