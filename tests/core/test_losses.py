import math

import torch

from allhere import AHAConfig, Decoder, ModelConfig
from allhere.losses import lm_loss, training_loss


def test_lm_loss_ignores_padding_and_masked_targets():
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 2] = 10.0  # confident and right about token 1
    ids = torch.tensor([[0, 2, 3, 4]])
    uniform = math.log(5)
    pad = torch.tensor([[True, True, False, False]])
    assert lm_loss(logits, ids, pad).item() < 1e-3  # only the first target counts
    full = lm_loss(logits, ids).item()
    assert abs(full - (lm_loss(logits[:, :2], ids[:, :2]).item() + 2 * uniform) / 3) < 1e-5
    mask = torch.tensor([[True, False, True, True]])
    assert abs(lm_loss(logits, ids, loss_mask=mask).item() - uniform) < 1e-5


def test_aha_loss_adds_lambda_times_l_reg():
    cfg = ModelConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=2,
                      mechanism=AHAConfig(window=2, router_init="neutral"))
    model = Decoder(cfg)
    ids = torch.randint(0, 30, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 6:] = False
    out = model(ids)
    loss = training_loss(out, ids, lam=0.1, padding_mask=pad)
    assert torch.allclose(loss.total, loss.lm + 0.1 * out.routing.l_reg(pad))
    assert torch.allclose(loss.mu_f, out.routing.mu_f(pad))
