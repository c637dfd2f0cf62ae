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


def test_segment_starts_of_padded_batches():
    from allhere.masks import segment_starts

    starts = segment_starts(_padded([(0, 0), (3, 0), (1, 2)], 8), 8, 8)
    assert starts.tolist() == [[0] * 8, [-1] * 3 + [3] * 5, [-1] + [1] * 5 + [-1] * 2]
    assert segment_starts(_padded([(2, 0), (0, 0)], 8, q_len=1), 1, 8).tolist() == [[2], [0]]  # a decode step
    m = _padded([(3, 0)], 8)
    m[0, 0, :3] = True  # transformers may un-mask the rows of padding queries: they see the padding
    assert segment_starts(m, 8, 8).tolist() == [[0] * 3 + [3] * 5]


def test_segment_starts_of_packed_documents():
    from allhere.masks import segment_starts

    same_doc = lambda b, h, q, k: (q < 3) == (k < 3)  # noqa: E731 -- documents [0, 3) and [3, 8)
    m = dense_mask(and_masks(causal, same_doc), 8, 8)
    assert segment_starts(m, 8, 8).tolist() == [[0, 0, 0, 3, 3, 3, 3, 3]]
    chunk = dense_mask(and_masks(causal, same_doc), 4, 8)  # the last 4 queries of the 8 keys
    assert segment_starts(chunk, 4, 8).tolist() == [[3, 3, 3, 3]]


def test_segment_starts_refuses_other_masks():
    from allhere.masks import segment_starts

    m = _padded([(0, 0)], 8)
    assert segment_starts(dense_mask(sliding_window(3), 8, 8), 8, 8) is None  # windows are not segments
    hole = _padded([(0, 0)], 8)
    hole[..., 2] = False  # a key in the middle that nobody sees
    assert segment_starts(hole, 8, 8) is None
    assert segment_starts(m.expand(1, 2, 8, 8), 8, 8) is None  # per-head masks
    assert segment_starts(m.float(), 8, 8) is None
    skip_self = _padded([(0, 0)], 8)
    skip_self[0, 0, 4, 4] = False  # query 4 does not see itself, but later queries read its position
    assert segment_starts(skip_self, 8, 8) is None
    assert segment_starts(torch.ones(1, 1, 8, 8, dtype=torch.bool), 8, 8).tolist() == [[0] * 8]  # ANDed with causal
    assert segment_starts(torch.zeros(1, 1, 8, 8, dtype=torch.bool), 8, 8).tolist() == [[-1] * 8]


def test_segment_starts_reads_a_new_or_changed_mask_afresh(monkeypatch):
    import allhere.masks as masks

    reads = []
    real = masks._segment_starts
    monkeypatch.setattr(masks, "_segment_starts", lambda *a: reads.append(1) or real(*a))
    m = _padded([(2, 0)], 8)
    assert masks.segment_starts(m, 8, 8).tolist() == [[-1] * 2 + [2] * 6]
    assert masks.segment_starts(m, 8, 8).tolist() == [[-1] * 2 + [2] * 6]
    assert len(reads) == 1  # the same tensor (the next layer): the kept answer
    m[0, 0, 3, 2] = False  # changed in place: a hole, read afresh
    assert masks.segment_starts(m, 8, 8) is None and len(reads) == 2
    assert masks.segment_starts(_padded([(4, 0)], 8), 8, 8).tolist() == [[-1] * 4 + [4] * 4]
    with torch.inference_mode():
        frozen = _padded([(1, 0)], 8)
        assert masks.segment_starts(frozen, 8, 8).tolist() == [[-1] + [1] * 7]
        assert masks.segment_starts(frozen, 8, 8).tolist() == [[-1] + [1] * 7]
    assert len(reads) == 5  # inference tensors: no version counter, always read
