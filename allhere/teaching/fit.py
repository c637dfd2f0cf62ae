"""Fit a layer's router to the teacher's labels: which (token, head) pairs of the layer cost the most when read
locally, predicted from the router's input X (the attention block's input, what ``AHAConfig``'s router reads).

Per layer, the pairs whose cost is in the top ``mu_f`` of the layer are the positives of a weighted logistic
regression on the standardised X (the router is linear in X: S = sigmoid(X W + b)); positives are weighted by
(1 - mu_f) / mu_f so that both classes count alike, the positions that answer a planted fact by ``ANSWER_WEIGHT``
(the rare tokens that need a distant one most), and the weights are kept small by an L2 penalty. At those
positions the positives are their own costliest ``ANSWER_SHARE`` of pairs, not the layer's top ``mu_f``: a question
needs more of its heads global than an average token (the per-token oracle opens 35% of a passkey question's
pairs at a 10% budget), and against the layer's threshold only the heads that read the fact itself count there,
not the ones that turn the answer by what else they read. On SmolLM2 80% (taught at 25%) found 19 of 20
passkeys where a half (taught at 20%) found 15, at about the same held-out mu_f (14.4% / 14.8%) and 0.3 points
less held-out quality (docs/real-model.md). The standardisation
is folded back into W and b, so the router reads X as it is. Chosen by measurement on SmolLM2-135M (docs/real-model.md):
a ridge regression of the cost's log ranks held-out pairs worse (recall of the costliest 10%: 0.31 against 0.39)
and its budget drifts more from calibration text to other text.
"""

from __future__ import annotations

import torch

ANSWER_WEIGHT = 10.0  # weight of a position that answers a planted fact in the fit
ANSWER_SHARE = 0.8  # at those positions the positives are their own costliest 80% of the layer's pairs
WEIGHT_DECAY = 1e-3  # L2 penalty on the standardised weights
STEPS, LR = 60, 0.05  # full-batch Adam steps of the fit (more change little on SmolLM2), their step size


def fit_router(x: torch.Tensor, cost: torch.Tensor, mu_f: float, weight: torch.Tensor | None = None,
               steps: int = STEPS, answers: torch.Tensor | None = None,
               answer_share: float = ANSWER_SHARE) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [heads, d], bias [heads]) in float32 of a router whose logits rank each head's pairs as the cost does:
    x [tokens, d] the router's inputs, cost [tokens, heads] what reading locally costs there, ``weight`` [tokens]
    the tokens' weights in the fit (None: all 1). ``answers`` [tokens] bool: the tokens that answer a planted fact,
    whose positives are their own costliest ``answer_share`` of pairs (None: none such). The logits are not yet
    shifted to a budget."""
    x = x.float()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-3)
    xn = (x - mean) / std
    labels = (cost > torch.quantile(even_sample(cost.flatten()), 1.0 - mu_f)).float()
    if answers is not None and bool(answers.any()):
        asked = cost[answers]
        labels[answers] = (asked > torch.quantile(even_sample(asked.flatten()), 1.0 - answer_share)).float()
    w = torch.zeros(x.shape[1], cost.shape[1], requires_grad=True)
    b = torch.zeros(cost.shape[1], requires_grad=True)
    sample = torch.ones(x.shape[0]) if weight is None else weight.float()
    sample = (sample / sample.mean())[:, None]
    positive = torch.tensor((1.0 - mu_f) / mu_f)
    opt = torch.optim.Adam([w, b], lr=LR)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            bce = torch.nn.functional.binary_cross_entropy_with_logits(xn @ w + b, labels, pos_weight=positive,
                                                                       reduction="none")
            ((bce * sample).mean() + WEIGHT_DECAY * (w * w).sum()).backward()
            opt.step()
    w, b = w.detach(), b.detach()
    return (w / std[:, None]).T.contiguous(), b - (mean / std) @ w


def even_sample(x: torch.Tensor, most: int = 1 << 22) -> torch.Tensor:
    """An even subsample of a flat tensor (``torch.quantile`` takes at most 2^24 values)."""
    return x if x.numel() <= most else x[torch.linspace(0, x.numel() - 1, most).long()]
