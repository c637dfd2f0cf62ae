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


def _padded(lengths_left_right, kv_len, q_len=None):
    """Hugging Face's layout for a padded batch: causal over each sequence's real keys."""
    q_len = q_len or kv_len
    rows = []
    for left, right in lengths_left_right:
        real = torch.zeros(kv_len, dtype=torch.bool)
        real[left:kv_len - right] = True
        rows.append(dense_mask(causal, q_len, kv_len)[0, 0] & real)
    return torch.stack(rows)[:, None]


def test_padding_starts_reads_left_and_right_padding():
    from allhere.masks import padding_starts

    assert padding_starts(_padded([(0, 0), (3, 0), (1, 2)], 8), 8, 8).tolist() == [0, 3, 1]
    assert padding_starts(_padded([(2, 0), (0, 0)], 8, q_len=1), 1, 8).tolist() == [2, 0]  # a decode step
    m = _padded([(3, 0)], 8)
    m[0, 0, :3] = True  # rows of padding queries may hold anything (transformers un-masks them)
    assert padding_starts(m, 8, 8).tolist() == [3]


def test_padding_starts_refuses_other_masks():
    from allhere.masks import padding_starts

    m = _padded([(0, 0)], 8)
    docs = m & (dense_mask(lambda b, h, q, k: (q < 4) == (k < 4), 8, 8))  # two packed documents
    assert padding_starts(docs, 8, 8) is None
    assert padding_starts(dense_mask(sliding_window(3), 8, 8), 8, 8) is None
    hole = _padded([(0, 0)], 8)
    hole[..., 2] = False  # a padding key in the middle
    assert padding_starts(hole, 8, 8) is None
    assert padding_starts(m.expand(1, 2, 8, 8), 8, 8) is None  # per-head masks are not padding
    assert padding_starts(m.float(), 8, 8) is None
    assert padding_starts(torch.ones(1, 1, 8, 8, dtype=torch.bool), 8, 8) is None  # bidirectional
    assert padding_starts(torch.zeros(1, 1, 8, 8, dtype=torch.bool), 8, 8) is None  # nothing real
