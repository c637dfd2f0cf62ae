"""``TrainConfig(compile=True)``: the training forward runs under torch.compile and trains the same model
(the same losses and weights up to float rounding, the checkpoint the eager run's layout)."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from allhere.config import TrainConfig
from allhere.runtime.model_checkpoint import load_model
from allhere.validation import ConfigError

import train_worker  # noqa: E402


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path):
    cfg = dataclasses.replace(train_worker.CFG, steps=4, ckpt_every=4)
    eager = train_worker.run(tmp_path / "eager" / "c.safetensors", cfg=cfg)
    counters.clear()
    compiled = train_worker.run(tmp_path / "compiled" / "c.safetensors", cfg=dataclasses.replace(cfg, compile=True))
    assert counters["stats"]["unique_graphs"] > 0  # dynamo did compile the forward
    for a, b in zip(eager["history"], compiled["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["mu_f"] == pytest.approx(b["mu_f"], abs=1e-3)
    one, two = (load_model(tmp_path / d / "c.safetensors")[0].state_dict() for d in ("eager", "compiled"))
    assert one.keys() == two.keys()  # no "_orig_mod." prefixes: the model itself was saved
    assert all(torch.allclose(one[k], two[k], rtol=1e-3, atol=1e-5) for k in one)


def test_compile_must_be_a_bool():
    with pytest.raises(ConfigError, match="compile"):
        TrainConfig(compile="yes")
