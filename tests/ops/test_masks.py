"""Mask predicates, segment starts read off masks, and the dense AHA reference under segment masks."""

import pytest
import torch

from allhere.masks import (
    and_masks,
    causal,
    dense_mask,
    or_masks,
    segment_starts,
    sliding_window,
)
from allhere.ops.aha import aha_attention_reference
from allhere.ops.common import segment_mask

from helpers import brute_force_aha, rel_err
from helpers import segment_mask as mask_of_layout


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
    starts = segment_starts(_padded([(0, 0), (3, 0), (1, 2)], 8), 8, 8)
    assert starts.tolist() == [[0] * 8, [-1] * 3 + [3] * 5, [-1] + [1] * 5 + [-1] * 2]
    assert segment_starts(_padded([(2, 0), (0, 0)], 8, q_len=1), 1, 8).tolist() == [[2], [0]]  # a decode step
    m = _padded([(3, 0)], 8)
    m[0, 0, :3] = True  # transformers may un-mask the rows of padding queries: they see the padding
    assert segment_starts(m, 8, 8).tolist() == [[0] * 3 + [3] * 5]


def test_segment_starts_of_packed_documents():
    same_doc = lambda b, h, q, k: (q < 3) == (k < 3)  # noqa: E731 -- documents [0, 3) and [3, 8)
    m = dense_mask(and_masks(causal, same_doc), 8, 8)
    assert segment_starts(m, 8, 8).tolist() == [[0, 0, 0, 3, 3, 3, 3, 3]]
    chunk = dense_mask(and_masks(causal, same_doc), 4, 8)  # the last 4 queries of the 8 keys
    assert segment_starts(chunk, 4, 8).tolist() == [[3, 3, 3, 3]]


def test_segment_starts_refuses_other_masks():
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


# (document boundaries, left padding per sequence, right padding per sequence)
LAYOUTS = {"left-pad": ([], [0, 5], [0, 0]), "right-pad": ([], [0, 0], [6, 0]), "documents": ([7, 16], [0, 0], [0, 0]),
           "documents+pads": ([11], [3, 0], [0, 4]), "nothing-real": ([], [0, 20], [0, 0])}


def brute_force_segments(q, k, v, gate, window, row_start):
    """One (batch, query) at a time, the segment rule applied directly: the query at position p sees keys
    row_start..p only (nothing for -1), and within them the window / full rule (``brute_force_aha`` over
    every head, in float64)."""
    b, h, lq, d = q.shape
    off = k.shape[2] - lq
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    for bi in range(b):
        for i in range(lq):
            start, pos = int(row_start[bi, i]), off + i
            if start >= 0:
                keys = slice(start, pos + 1)
                out[bi, :, i] = brute_force_aha(q[bi:bi + 1, :, i:i + 1], k[bi:bi + 1, :, keys], v[bi:bi + 1, :, keys],
                                                gate[bi:bi + 1, :, i:i + 1], window)[0, :, 0]
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lq", [20, 7, 1], ids=["prefill", "chunk", "decode"])
def test_segment_mask_is_the_layouts_mask(layout, lq):
    mask = mask_of_layout(2, lq, 20, *LAYOUTS[layout])
    assert torch.equal(segment_mask(segment_starts(mask, lq, 20), lq, 20), mask)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lq", [20, 7, 1], ids=["prefill", "chunk", "decode"])
@pytest.mark.parametrize("window", [1, 4, 30])
def test_reference_under_segments_equals_brute_force(layout, lq, window):
    """The dense reference with row_start (and with the same segments as a bool mask) equals the segment
    rule applied query by query; a query that sees nothing gives zero."""
    q, k, v = torch.randn(2, 4, lq, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    gate = torch.rand(2, 4, lq) < 0.4
    mask = mask_of_layout(2, lq, 20, *LAYOUTS[layout])
    starts = segment_starts(mask, lq, 20)
    want = brute_force_segments(q, k, v, gate, window, starts)
    assert rel_err(aha_attention_reference(q, k, v, gate, window, row_start=starts), want) < 1e-6
    assert rel_err(aha_attention_reference(q, k, v, gate, window, mask=mask), want) < 1e-6
    out = aha_attention_reference(q, k, v, gate, window, row_start=starts)
    assert torch.all(out.transpose(1, 2)[starts < 0] == 0)
