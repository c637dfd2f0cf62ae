"""Gate patterns for benchmarks: long-tailed across heads (seeds/003 Fig. 4) and uniform random."""

import torch


def long_tailed(batch: int, heads: int, n: int, mu: float, generator=None, device="cpu") -> torch.Tensor:
    """Head 0 always global, the other heads share the rest of the budget: overall mean ~= mu."""
    rest = max(0.0, (mu * heads - 1.0) / (heads - 1))
    gate = torch.rand(batch, heads, n, generator=generator, device=device) < rest
    gate[:, 0] = True
    return gate


def uniform(batch: int, heads: int, n: int, mu: float, generator=None, device="cpu") -> torch.Tensor:
    return torch.rand(batch, heads, n, generator=generator, device=device) < mu


PATTERNS = {"long-tailed": long_tailed, "uniform": uniform}


def flop_limit(mu: float, window: int, n: int) -> float:
    """Prefill speed-up limit over dense causal: 1 / (mu + 2 (1 - mu) w / n) (shared/ANCHORS.md)."""
    return 1.0 / (mu + 2.0 * (1.0 - mu) * window / n)
