import pytest
import torch

from allhere.routing import LayerRouting, Routing


def hand_made():
    # 2 layers, batch 2, 2 heads, 3 tokens; the second sequence's last token is padding.
    s0 = torch.tensor([[[0.9, 0.1, 0.6], [0.2, 0.2, 0.2]], [[0.8, 0.4, 1.0], [0.3, 0.7, 1.0]]])
    s1 = torch.tensor([[[0.1, 0.1, 0.1], [0.6, 0.6, 0.6]], [[0.5, 0.9, 1.0], [0.1, 0.2, 1.0]]])
    routing = Routing([1, 3], [LayerRouting(s, s > 0.5) for s in (s0, s1)])
    pad = torch.tensor([[True, True, True], [True, True, False]])
    return routing, pad, s0, s1


def test_l_reg_and_mu_f_exclude_padding():
    routing, pad, s0, s1 = hand_made()
    real_scores = [0.9, 0.1, 0.6, 0.2, 0.2, 0.2, 0.8, 0.4, 0.3, 0.7,
                   0.1, 0.1, 0.1, 0.6, 0.6, 0.6, 0.5, 0.9, 0.1, 0.2]
    assert routing.l_reg(pad).item() == pytest.approx(sum(real_scores) / 20)
    assert routing.mu_f(pad).item() == pytest.approx(sum(x > 0.5 for x in real_scores) / 20)
    # without a mask the padded token counts (its scores are 1.0, all gates open)
    assert routing.mu_f().item() == pytest.approx((sum(x > 0.5 for x in real_scores) + 4) / 24)


def test_usage_per_layer_and_head():
    routing, pad, _, _ = hand_made()
    u = routing.usage(pad)
    assert u.shape == (2, 2)
    # layer 1 head 0: gates 1,0,1 | 1,0 -> 3/5 ; layer 3 head 1: 1,1,1 | 0,0 -> 3/5
    assert u[0, 0].item() == pytest.approx(3 / 5)
    assert u[1, 1].item() == pytest.approx(3 / 5)
    assert u.mean().item() == pytest.approx(routing.mu_f(pad).item())


def test_l_reg_is_differentiable_and_mask_shape_checked():
    s = torch.rand(1, 2, 4, requires_grad=True)
    r = Routing([0], [LayerRouting(s, s > 0.5)])
    r.l_reg().backward()
    assert torch.allclose(s.grad, torch.full_like(s, 1 / 8))
    with pytest.raises(ValueError, match="padding_mask"):
        r.mu_f(torch.ones(1, 3, dtype=torch.bool))
