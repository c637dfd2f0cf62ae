"""Context parallelism is a capability a mechanism declares through the mechanism interface: a mechanism
defined here, in the test, runs through the ring over 2 gloo processes with the loss and every gradient of
the one-process run, with no library file changed; a mechanism that cannot is refused in one line naming
it and the reason."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from allhere import Decoder, ModelConfig, register  # noqa: E402
from allhere.distributed import layouts  # noqa: E402
from allhere.distributed.context import context_parallel  # noqa: E402
from allhere.losses import training_loss  # noqa: E402
from allhere.masks import and_masks, causal  # noqa: E402
from allhere.mechanisms import (  # noqa: E402
    AAMoEConfig,
    AttentionMechanism,
    ContextParallelPlan,
    FullConfig,
)
from allhere.ops.common import default_scale, repeat_kv  # noqa: E402

import dist_worker  # noqa: E402

N, BATCH, VOCAB, TOL = 32, 2, 64, 1e-5
CAP = 2.0  # soft cap of the logits: small enough that it changes the result


def every_third(b, h, q_idx, kv_idx):  # no ``tiles`` test: the ring evaluates it over each block
    return (q_idx - kv_idx) % 3 == 0


def toy_scores(q, k, q_pos, k_pos, scale):
    """Soft-capped logits with a distance penalty per head (head i: slope 0.1 (i + 1)): needs the positions."""
    slope = 0.1 * torch.arange(1, q.shape[1] + 1, dtype=q.dtype, device=q.device).view(1, -1, 1, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    return CAP * torch.tanh(s / CAP) - slope * (q_pos - k_pos).to(q.dtype)


@dataclass(frozen=True)
class CappedThirdsConfig:
    """Each query reads itself and every third key before it, with soft-capped, distance-penalised logits."""

    kind: str = field(default="test_capped_thirds", init=False)


@register(CappedThirdsConfig, summary="every third key, soft-capped logits (a test mechanism)")
class CappedThirds(AttentionMechanism):
    def forward(self, q, k, v, call, cache=None):  # whole sequences only (no cache, no segments)
        n = q.shape[2]
        pos = torch.arange(n)
        s = toy_scores(q.float(), repeat_kv(k, q.shape[1]).float(), pos.view(1, 1, -1, 1), pos.view(1, 1, 1, -1),
                       default_scale(q.shape[-1], call.scale))
        allowed = and_masks(causal, every_third)(0, 0, pos.view(-1, 1), pos.view(1, -1))
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        return (p @ repeat_kv(v, q.shape[1]).float()).to(q.dtype), None

    def context_parallel_plan(self, call, n):
        return ContextParallelPlan(reads=and_masks(causal, every_third), scores=toy_scores)


@dataclass(frozen=True)
class NoRingConfig:
    kind: str = field(default="test_no_ring", init=False)


@register(NoRingConfig, summary="causal attention without a context-parallel plan (a test mechanism)")
class NoRing(AttentionMechanism):
    def forward(self, q, k, v, call, cache=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), None


def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               layer_mechanisms=(CappedThirdsConfig(), FullConfig())))


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, N), generator=torch.Generator().manual_seed(1))


def grads(net) -> dict:
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def sharded(rank, world, tmp, layouts_):
    from allhere.distributed.context import mean_over_ranks

    out = {}
    for layout in layouts_:
        net = model()
        with context_parallel(net, layout=layout) as cp:
            ids, pos, targets = cp.shard(batch())
            res = net(ids, positions=pos)
            loss = cp.loss(res, targets, 0.0)
            loss.total.backward()
        g = grads(net)
        for t in g.values():
            dist.all_reduce(t)
            t /= world
        out[layout] = {"total": mean_over_ranks(loss.total), "grads": g}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_toy_mechanism_runs_context_parallel(tmp_path, world):
    net = model()
    ids = batch()
    loss = training_loss(net(ids), ids, 0.0)
    loss.total.backward()
    ref = grads(net)
    per_rank = dist_worker.launch(sharded, world, tmp_path, list(layouts.LAYOUTS))
    for rank, res in enumerate(per_rank):
        for layout in layouts.LAYOUTS:
            got = res[layout]
            assert abs(got["total"] - loss.total.item()) <= TOL, (rank, layout, got["total"], loss.total.item())
            assert set(got["grads"]) == set(ref)
            for name, g in ref.items():
                assert g.abs().max() > 0, name
                err = (got["grads"][name] - g).abs().max().item()
                assert err <= TOL, (rank, layout, name, err)


def test_toy_mechanism_logits_matter():
    """The soft cap and the distance penalty change the output (else the test above proves little)."""
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    pos = torch.arange(6)
    plain = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    capped = toy_scores(q, k, pos.view(1, 1, -1, 1), pos.view(1, 1, 1, -1), 8 ** -0.5)
    assert (plain - capped).abs().max() > 0.5


@pytest.mark.parametrize("cfg,name,why", [
    (AAMoEConfig(chunk=4, experts=2), "AAMoEAttention (aamoe)", "budget"),
    (NoRingConfig(), "NoRing (test_no_ring)", "does not implement context_parallel_plan"),
], ids=["aamoe", "undeclared"])
def test_refused_in_one_line(cfg, name, why):
    net = Decoder(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                              layer_mechanisms=(FullConfig(), cfg)))
    with pytest.raises(NotImplementedError) as err:
        with context_parallel(net):
            pass
    msg = str(err.value)
    assert "\n" not in msg and f"layer 1: {name}: " in msg and why in msg, msg
    assert "layer 0" not in msg
    assert all("forward" not in vars(b.attn.mechanism) for b in net.blocks)
