import torch

from allhere.masks import and_masks, causal, dense_mask, or_masks, sliding_window


def test_window_counts_current_token():
    m = dense_mask(sliding_window(3), 6, 6)[0, 0]
    # query 4 sees keys 2, 3, 4: the 3 most recent keys including itself (q - k < w)
    assert m[4].nonzero().flatten().tolist() == [2, 3, 4]
    assert m.sum(-1).tolist() == [1, 2, 3, 3, 3, 3]


def test_bottom_right_alignment_for_decode():
    m = dense_mask(sliding_window(2), 1, 5)[0, 0, 0]
    assert m.tolist() == [False, False, False, True, True]
    assert dense_mask(causal, 2, 5)[0, 0].sum(-1).tolist() == [4, 5]


def test_combinators():
    sink = lambda b, h, q, k: k == 0  # noqa: E731
    m = dense_mask(and_masks(causal, or_masks(sliding_window(2), sink)), 5, 5)[0, 0]
    assert m[4].nonzero().flatten().tolist() == [0, 3, 4]
    assert torch.equal(dense_mask(and_masks(causal), 4, 4), dense_mask(causal, 4, 4))
