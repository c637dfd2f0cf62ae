"""Context parallelism of a whole Decoder (``allhere.distributed.context``) over 2 and 4 gloo processes:
the sharded forward + backward equals the one-process run in loss and every parameter gradient, for full,
sliding, AHA (routers trained) and Longformer, in both layouts; the activations saved per rank fall to
about 1/world; ``train(..., parallel=ParallelConfig(...))`` gives the one-process training run."""

import sys
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from allhere import ConfigError  # noqa: E402
from allhere.config import ModelConfig  # noqa: E402
from allhere.distributed import layouts  # noqa: E402
from allhere.distributed.context import IGNORE, context_parallel, shard_batch  # noqa: E402
from allhere.mechanisms import AAMoEConfig, FullConfig  # noqa: E402
from allhere.model import Decoder  # noqa: E402
from allhere.runtime.model_checkpoint import load_model  # noqa: E402

import dist_context_worker as W  # noqa: E402
import dist_worker  # noqa: E402

TOL = 1e-5
KINDS = list(W.MECHANISMS)
CASES = [(kind, layout) for kind in KINDS for layout in layouts.LAYOUTS]


@pytest.fixture(scope="module", params=[2, 4])
def sharded_run(request, tmp_path_factory):
    world = request.param
    per_rank = dist_worker.launch(W.sharded, world, tmp_path_factory.mktemp(f"cp{world}"), CASES)
    return world, per_rank


@pytest.fixture(scope="module")
def single():
    return {kind: W.single(kind) for kind in KINDS}


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout", CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_sharded_equals_single_process(sharded_run, single, kind, layout):
    world, per_rank = sharded_run
    ref = single[kind]
    for rank, res in enumerate(per_rank):
        got = res[f"{kind}-{layout}"]
        fields = ["total", "lm"] + (["l_reg", "mu_f"] if kind == "aha" else [])
        for f in fields:
            assert abs(got[f] - ref[f]) <= TOL, (world, rank, f, got[f], ref[f])
        assert set(got["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            assert g.abs().max() > 0, f"{name}: no gradient in the reference"
            err = (got["grads"][name] - g).abs().max().item()
            assert err <= TOL, (world, rank, name, err)
    if kind == "aha":  # the routers train, and both kinds of gate occur
        assert any(".mechanism.router." in name for name in ref["grads"])
        assert 0.2 < ref["mu_f"] < 0.8


def test_activations_per_rank_fall(sharded_run, single):
    """Bytes autograd saves during the forward (parameters excluded), per rank vs one process: the
    attention mechanisms alone and the whole model."""
    world, per_rank = sharded_run
    bound = {2: 0.55, 4: 0.35}[world]
    for kind, layout in CASES:
        ref = single[kind]["saved"]
        for res in per_rank:
            got = res[f"{kind}-{layout}"]["saved"]
            for part in ("attention", "model"):
                ratio = got[part] / ref[part]
                assert 0 < ratio <= bound, (world, kind, layout, part, got[part], ref[part], ratio)


def test_refusals(sharded_run):
    _, per_rank = sharded_run
    for res in per_rank:
        err = res["errors"]
        assert err["positions"] is not None and "positions=" in err["positions"]
        assert err["segments"] is not None and "segment_starts" in err["segments"]
        assert err["restored"]


def test_unsupported_mechanism_is_named():
    net = Decoder(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                              layer_mechanisms=(FullConfig(), AAMoEConfig(chunk=4, experts=2))))
    with pytest.raises(NotImplementedError, match="layer 1: AAMoEAttention"):
        with context_parallel(net):
            pass
    assert all("forward" not in vars(b.attn.mechanism) for b in net.blocks)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_shard_batch_shifts_before_sharding(layout):
    world, n = 4, 16
    ids = torch.arange(2 * n).view(2, n)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 5] = False  # the target token 5 of row 1 does not count
    parts = [shard_batch(ids, layout, r, world, loss_mask=mask) for r in range(world)]
    for r, p in enumerate(parts):
        assert torch.equal(p.positions, layouts.positions(n, layout, world, r))
        assert torch.equal(p.ids, ids[:, p.positions])
    targets = layouts.unshard([p.targets for p in parts], layout, dim=1)
    want = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], dim=1)
    want[1, 4] = IGNORE
    assert torch.equal(targets, want)


@pytest.mark.slow
def test_train_context_parallel_matches_one_process(tmp_path):
    path = tmp_path / "cp" / "checkpoint.safetensors"
    per_rank = dist_worker.launch(W.train_spawned, 2, tmp_path / "results", path, "zigzag")
    one = W.train_run(tmp_path / "one" / "checkpoint.safetensors")
    for res in per_rank:
        assert res["seen"] and set(res["seen"]) == {W.TRAIN_N // 2}, "the ring did not run on shards"
        assert len(res["history"]) == len(one["history"]) == W.train_cfg().steps
        for a, b in zip(res["history"], one["history"]):
            for f in ("loss", "lm", "mu_f"):
                assert abs(a[f] - b[f]) <= 2e-5, (a, b)
    exported, _ = load_model(path)
    single, _ = load_model(tmp_path / "one" / "checkpoint.safetensors")
    for (name, p), q in zip(exported.named_parameters(), single.parameters()):
        assert torch.allclose(p, q, atol=TOL), name


def test_train_refuses_before_starting(tmp_path):
    net = Decoder(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4,
                              mechanism=AAMoEConfig(chunk=4, experts=2)))
    from allhere.distributed import ParallelConfig
    from allhere.train import train

    batches = lambda s, m, g: torch.zeros(2, 8, dtype=torch.long)  # noqa: E731
    with pytest.raises(NotImplementedError, match="AAMoEAttention"):  # the model first, before the processes
        train(net, batches, W.train_cfg(), tmp_path / "x", progress=False, parallel=ParallelConfig(context_parallel=2))
    plain = Decoder(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4))
    with pytest.raises(ConfigError, match="context parallel 2 needs a multiple of 2 processes"):
        train(plain, batches, W.train_cfg(), tmp_path / "y", progress=False,
              parallel=ParallelConfig(context_parallel=2))
    assert not (tmp_path / "y").exists()
