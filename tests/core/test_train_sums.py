"""The training loop sums each step's losses on the device and reads them once a step (one host-device sync a
step, not three per micro-batch), logging what the micro-batches' losses average to."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from allhere.losses import training_loss
from allhere.train import model_lam, step_generator

import train_worker  # noqa: E402


def test_losses_are_read_once_a_step_and_log_the_micro_batches_mean(tmp_path, monkeypatch):
    cfg = dataclasses.replace(train_worker.CFG, steps=3, grad_accum=4, ckpt_every=100)
    with torch.no_grad():  # the first step's micro-batches on the untrained model, as the loop draws them
        model = train_worker.fresh_model()
        first = [training_loss(model(ids), ids, model_lam(model, cfg)) for ids in (
            train_worker.batches(step_generator(cfg.seed, 0, m), cfg.batch_size) for m in range(cfg.grad_accum))]
    reads = {"item": 0, "tolist": 0}  # by allhere's code (AdamW reads its step counts, kept on the host)
    for name in reads:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            reads[_name] += Path(sys._getframe(1).f_code.co_filename).parent.name == "allhere"
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    state = train_worker.run(tmp_path / "c.safetensors", cfg=cfg)
    monkeypatch.undo()
    assert reads == {"item": 0, "tolist": cfg.steps}
    logged = state["history"][0]
    assert logged["lm"] == pytest.approx(sum(x.lm.item() for x in first) / cfg.grad_accum, abs=1e-5)
    assert logged["mu_f"] == pytest.approx(sum(x.mu_f.item() for x in first) / cfg.grad_accum, abs=1e-5)
    assert logged["loss"] == pytest.approx(sum(x.total.item() for x in first) / cfg.grad_accum, abs=1e-5)
