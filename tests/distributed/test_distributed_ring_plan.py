"""The ring's plan and cost model without processes: layouts, skipping, balance."""

import pytest
import torch

from allhere.distributed import layouts
from allhere.distributed.env import detect
from allhere_recipes.cost import Shape, plan_for, ring_cost


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_shard_unshard_round_trip(layout):
    x = torch.arange(2 * 3 * 48).view(2, 3, 48)
    shards = [layouts.shard(x, layout, 4, r) for r in range(4)]
    assert torch.equal(layouts.unshard(shards, layout), x)
    assert torch.equal(torch.cat([layouts.positions(48, layout, 4, r) for r in range(4)]).sort().values,
                       torch.arange(48))


def test_sliding_at_scale_receives_at_most_one_block():
    n, d, shape = 1 << 20, 64, Shape()
    for layout in layouts.LAYOUTS:
        plan, _ = plan_for("sliding", n, d, layout, window=4096)
        block = shape.batch * shape.kv_heads * (n // d) * 2 * shape.head_dim * shape.elt
        for r in range(d):
            fwd = ring_cost(plan, shape, r)["forward"]
            assert fwd["bytes_received"] <= block
            assert plan.transfers(r) <= (1 if layout == "contiguous" else 2)


def test_zigzag_balances_causal_work():
    n, d, shape = 1 << 16, 8, Shape()
    spread = {}
    for layout in layouts.LAYOUTS:
        plan, _ = plan_for("full", n, d, layout)
        flops = [ring_cost(plan, shape, r)["forward"]["flops"] for r in range(d)]
        spread[layout] = max(flops) / min(flops)
    assert spread["zigzag"] == 1.0
    assert spread["contiguous"] >= d - 1


def test_aha_far_blocks_compute_only_global_rows():
    n, d, shape = 1 << 16, 8, Shape()
    full, _ = plan_for("full", n, d, "zigzag")
    aha, _ = plan_for("aha", n, d, "zigzag", window=1024, mu_f=0.07)
    f = max(ring_cost(full, shape, r)["forward"]["flops"] for r in range(d))
    a = max(ring_cost(aha, shape, r)["forward"]["flops"] for r in range(d))
    assert a < 0.35 * f


def test_one_process_is_not_distributed(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    assert detect() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert detect() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = detect()
    assert env is not None and env.world == 2 and env.main
