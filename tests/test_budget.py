import pytest
import torch

from allhere import AHAConfig, Decoder, ModelConfig, routed_layers
from allhere.analysis.budget import calibrate_tau, set_tau


def test_calibrated_tau_hits_the_requested_share_on_the_same_data():
    model = Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4,
                                mechanism=AHAConfig(window=3, router_init="neutral")))
    batches = [torch.randint(0, 50, (4, 64)) for _ in range(3)]
    tau = calibrate_tau(model, batches, 0.2)
    set_tau(model, tau)
    with torch.no_grad():
        mu = sum(model(b).routing.mu_f().item() for b in batches) / 3
    assert mu == pytest.approx(0.2, abs=0.01)
    assert all(m.cfg.tau == tau for _, m in routed_layers(model))
    with pytest.raises(ValueError):
        calibrate_tau(model, batches, 1.5)
