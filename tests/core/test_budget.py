import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from allhere import AHAConfig, ConfigError, Decoder, ModelConfig, routed_layers
from allhere.analysis.budget import calibrate_tau, set_tau
from allhere.config import TrainConfig
from allhere.train import LAM_RANGE, adapt_lam, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_worker  # noqa: E402


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


def test_adapt_lam_moves_lambda_towards_the_target_by_bounded_steps():
    cfg = TrainConfig(target_mu_f=0.1, lam_rate=0.05)
    assert adapt_lam(0.01, 0.2, cfg) == pytest.approx(0.01 * math.exp(0.05))  # twice the target: error +1
    assert adapt_lam(0.01, 0.9, cfg) == pytest.approx(0.01 * math.exp(0.05))  # the error is clipped to [-1, 1]
    assert adapt_lam(0.01, 0.05, cfg) == pytest.approx(0.01 * math.exp(-0.025))
    assert adapt_lam(0.01, 0.1, cfg) == pytest.approx(0.01)
    assert adapt_lam(LAM_RANGE[1], 1.0, cfg) == LAM_RANGE[1] and adapt_lam(LAM_RANGE[0], 0.0, cfg) == LAM_RANGE[0]


def test_training_towards_a_target_steers_lambda_and_resumes_it(tmp_path):
    """Every step moves lambda by that step's mu_f (logged, checkpointed); a run that crashed at step 6
    resumes with the lambda it had reached and ends where an uninterrupted run ends."""
    cfg = dataclasses.replace(train_worker.CFG, steps=12, target_mu_f=0.2, lam_rate=0.5)
    straight = train_worker.run(tmp_path / "straight" / "c.safetensors", cfg=cfg)
    hist = straight["history"]
    assert hist[0]["lam"] == 0.01  # the model's lambda to start
    for prev, now in zip(hist, hist[1:]):
        assert now["lam"] == pytest.approx(adapt_lam(prev["lam"], prev["mu_f"], cfg), rel=2e-3)
    assert len({h["lam"] for h in hist}) == len(hist)  # it moved every step

    def crash_at_6(step, micro, g):
        if step == 6:
            raise RuntimeError("crash")
        return train_worker.batches(g, cfg.batch_size)

    path = tmp_path / "crashed" / "c.safetensors"
    with pytest.raises(RuntimeError, match="crash"):
        train(train_worker.fresh_model(), crash_at_6, cfg, path, progress=False)
    resumed = train_worker.run(path, cfg=cfg)
    assert resumed["history"] == hist and resumed["lam"] == straight["lam"]


def test_a_target_needs_routed_layers(tmp_path):
    model = Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(ConfigError, match="target_mu_f = 0.1 needs a model with routed layers"):
        train(model, lambda s, m, g: torch.randint(0, 50, (2, 8), generator=g), TrainConfig(steps=1, target_mu_f=0.1),
              tmp_path / "c.safetensors", progress=False)
