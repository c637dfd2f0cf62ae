import pytest
import torch

import allhere.runtime.model_checkpoint as ckpt_mod
from allhere import AHAConfig, Decoder, ModelConfig
from allhere.config import TrainConfig
from allhere.runtime.model_checkpoint import CheckpointError, load_model, save_checkpoint
from allhere.train import make_optimizer, train


def tiny():
    return Decoder(ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, mechanism=AHAConfig(window=3)))


def test_round_trip(tmp_path):
    model = tiny()
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model, make_optimizer(model, TrainConfig()), {"step": 3})
    again, meta = load_model(path)
    assert meta["step"] == 3 and again.cfg == model.cfg
    ids = torch.randint(0, 40, (2, 9))
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert (tmp_path / "c.json").exists()


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, tiny(), None, {"step": 1})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(path)


def test_failed_write_keeps_the_good_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, tiny(), None, {"step": 1})
    good = path.read_bytes()

    def broken(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError):
        save_checkpoint(path, tiny(), None, {"step": 2})
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left
    assert ckpt_mod.read_checkpoint(path)[1]["step"] == 1


def test_existing_checkpoint_needs_resume(tmp_path):
    path = tmp_path / "run" / "c.safetensors"
    batches = lambda step, micro, g: torch.randint(0, 40, (2, 8), generator=g)  # noqa: E731
    cfg = TrainConfig(steps=2, batch_size=2, ckpt_every=1)
    train(tiny(), batches, cfg, path, progress=False)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="--resume"):
        train(tiny(), batches, cfg, path, progress=False)
    with pytest.raises(CheckpointError, match="other training settings"):
        train(tiny(), batches, TrainConfig(steps=3, batch_size=2, ckpt_every=1), path, resume=True, progress=False)
    assert path.read_bytes() == before
