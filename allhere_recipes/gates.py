"""Gate patterns of the benchmarks -- long-tailed across heads (the AHA paper's Figure 4) and uniform
random -- and the FLOP limit of AHA prefill against dense causal attention."""

import torch


def tail_share(heads: int, mu: float) -> float:
    """The share of global tokens of each head but head 0 when head 0 is always global and the mean is mu."""
    return max(0.0, (mu * heads - 1.0) / (heads - 1))


def long_tailed(batch: int, heads: int, n: int, mu: float, generator=None, device="cpu") -> torch.Tensor:
    """Head 0 always global, the other heads share the rest of the budget: overall mean ~= mu. With one
    head there is no tail to share: the uniform pattern."""
    if heads == 1:
        return uniform(batch, heads, n, mu, generator, device)
    gate = torch.rand(batch, heads, n, generator=generator, device=device) < tail_share(heads, mu)
    gate[:, 0] = True
    return gate


def uniform(batch: int, heads: int, n: int, mu: float, generator=None, device="cpu") -> torch.Tensor:
    """Every (token, head) global with probability mu."""
    return torch.rand(batch, heads, n, generator=generator, device=device) < mu


PATTERNS = {"long-tailed": long_tailed, "uniform": uniform}


def flop_limit(mu: float, window: int, n: int) -> float:
    """Prefill speed-up limit over dense causal attention, from the FLOPs alone: 1 / (mu + 2 (1 - mu) w / n)
    (a share mu of the queries attends to about n / 2 keys on average, the rest to w)."""
    return 1.0 / (mu + 2.0 * (1.0 - mu) * window / n)


def byte_limit(mu: float, window: int, n: int) -> float:
    """Decode speed-up limit over dense attention, from the cache bytes read alone: 1 / (mu + (1 - mu)
    min(1, w / n)) (a global query reads all n cached keys, a local one w of them)."""
    return 1.0 / (mu + (1.0 - mu) * min(1.0, window / n))
