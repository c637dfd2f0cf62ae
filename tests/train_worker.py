"""A small training run, shared by the resume test and the subprocess it kills."""

import sys
import time

import torch

from allhere import AAMoEConfig, AHAConfig, Decoder, ModelConfig
from allhere.config import TrainConfig
from allhere.train import train

CFG = TrainConfig(steps=30, batch_size=4, grad_accum=2, lr=3e-3, ckpt_every=1, log_every=1)


def fresh_model():
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               mechanism=AHAConfig(window=4, lam=0.01, router_init="neutral")))


def aamoe_model():
    """AA-MoE with its learned budget predictor, whose only gradient is the layer's aux_loss."""
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               mechanism=AAMoEConfig(chunk=4, experts=2, budget=1.5, predictor_weight=1.0)))


def batches(g, batch_size, delay=0.0):
    time.sleep(delay)
    return torch.randint(0, 50, (batch_size, 24), generator=g)


def run(path, delay=0.0, cfg=CFG, model_fn=fresh_model):
    torch.set_num_threads(1)
    return train(model_fn(), lambda step, micro, g: batches(g, cfg.batch_size, delay), cfg, path, resume=True,
                 progress=False)


if __name__ == "__main__":
    run(sys.argv[1], delay=float(sys.argv[2]))
