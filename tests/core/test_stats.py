import math

import pytest
import torch

from allhere.analysis.stats import StatsAccumulator
from allhere.routing import LayerRouting, Routing


def routing_of(gates):  # gates [L, b, h, n] bool
    return Routing(list(range(gates.shape[0])), [LayerRouting(g.float(), g) for g in gates])


def test_usage_gaps_sorting_and_top_share_on_hand_made_gates():
    g = torch.zeros(2, 1, 2, 10, dtype=torch.bool)
    g[0, 0, 0] = True  # layer 0 head 0: global everywhere -> gap 1
    g[0, 0, 1, [2, 7]] = True  # one gap of 5
    g[1, 0, 0, [0, 3, 9]] = True  # gaps 3 and 6 -> mean 4.5
    g[1, 0, 1, 4] = True  # a single call: no gap
    acc = StatsAccumulator()
    acc.update(routing_of(g))
    s = acc.result()
    assert torch.allclose(s.usage, torch.tensor([[1.0, 0.2], [0.3, 0.1]]))
    gap = s.mean_gap
    assert gap[0, 0].item() == 1.0 and gap[0, 1].item() == 5.0 and gap[1, 0].item() == 4.5
    assert math.isnan(gap[1, 1].item())
    assert s.sorted_usage()[0] == (0, 0, 1.0) and s.sorted_usage()[-1][:2] == (1, 1)
    assert s.top_share(0.1) == pytest.approx(1.0 / 1.6)  # one head of four: the busiest
    assert s.mu_f == pytest.approx(1.6 / 4)


def test_padding_is_excluded_and_batches_accumulate():
    g = torch.ones(1, 2, 1, 6, dtype=torch.bool)
    pad = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    acc = StatsAccumulator()
    acc.update(routing_of(g), pad)
    acc.update(routing_of(torch.zeros(1, 1, 1, 6, dtype=torch.bool)))
    s = acc.result()
    assert s.tokens == 15
    assert s.usage.item() == pytest.approx(9 / 15)
    assert s.mean_gap.item() == 1.0
    with pytest.raises(ValueError):
        StatsAccumulator().result()
