import math

import pytest
import torch

from allhere import Decoder, ModelConfig, SlidingConfig
from allhere.eval.perplexity import rolling_perplexity, rolling_windows
from allhere.losses import lm_loss


@pytest.mark.parametrize("n", [2, 3, 17, 64, 65, 200])
@pytest.mark.parametrize("seq_len,stride", [(8, 1), (8, 4), (8, 8), (16, 5)])
def test_every_target_scored_once_with_context(n, seq_len, stride):
    spans = rolling_windows(n, seq_len, stride)
    scored = [t for _, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, n))
    for i, (start, end, first) in enumerate(spans):
        assert end - start <= seq_len and start < first
        if i:  # later windows keep seq_len - stride tokens of context (or all there is)
            assert first - start >= min(seq_len - stride, first) or stride == seq_len


def test_sliding_model_rolling_equals_one_pass():
    """L layers of window w reach L * (w - 1) tokens back: with that much context, rolling changes nothing."""
    model = Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mechanism=SlidingConfig(window=4)))
    docs = [torch.randint(0, 50, (n,)) for n in (40, 9, 77)]
    res = rolling_perplexity(model, docs, seq_len=12, stride=6)  # context 6 = 2 layers x (4 - 1)
    with torch.no_grad():
        total = sum(lm_loss(model(d[None]).logits, d[None]).item() * (len(d) - 1) for d in docs)
    assert res["tokens"] == sum(len(d) - 1 for d in docs)
    assert res["loss"] == pytest.approx(total / res["tokens"], rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]))


def test_min_len_skips_short_documents():
    model = Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2))
    docs = [torch.randint(0, 50, (n,)) for n in (5, 30)]
    res = rolling_perplexity(model, docs, seq_len=16, min_len=10)
    assert res["skipped_docs"] == 1 and res["tokens"] == 29
    with pytest.raises(ValueError):
        rolling_perplexity(model, docs, seq_len=16, min_len=100)
