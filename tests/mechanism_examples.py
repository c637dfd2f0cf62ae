"""One tiny example config per built-in mechanism kind, and what each kind declares about the contract
(tests/mechanisms/test_contract.py; tests/mechanisms/test_backend.py runs the same examples on the reference backend).

A kind registered by the package without an example here fails those tests. A kind is held to every
contract item unless it declares the item's refusal in ``REFUSALS``.
"""

import pytest

from allhere import (
    AAMoEConfig,
    AHAConfig,
    AllAttentionConfig,
    BigBirdConfig,
    DARConfig,
    DARLatentConfig,
    DilatedConfig,
    FullConfig,
    LongformerConfig,
    SinksConfig,
    SlidingConfig,
    registry,
)
from allhere.mechanisms.aamoe import set_budget_source

# Small windows, blocks and chunks: the contract runs 40-token sequences, past every window.
EXAMPLES = {
    "full": FullConfig(),
    "sliding": SlidingConfig(window=8),
    "aha": AHAConfig(window=8, router_init="neutral"),  # about half the gates open
    "dar": DARConfig(window=8, d_down=8),
    "dar_latent": DARLatentConfig(window=8, d_down=8, rope_pairs=1),
    "sinks": SinksConfig(window=8, n_sinks=2),
    "dilated": DilatedConfig(window=4, dilation=2),
    "longformer": LongformerConfig(window=8, global_first=2),
    "bigbird": BigBirdConfig(block=8, window_blocks=2, global_blocks=1, random_blocks=1),
    "all_attention": AllAttentionConfig(n_mem=8),
    "aamoe": AAMoEConfig(chunk=8, experts=2),
}

# Variants of a kind held to the same contract (named "kind-variant"): the paths a kind takes only with some setting.
VARIANTS = {
    "aha-sinks": AHAConfig(window=8, sinks=2, router_init="neutral"),  # local rows read the first 2 tokens too
}

# kind -> {contract item: (exception type, message pattern)} for what the kind refuses, with the error it
# gives. Items: "cache" (KV-cache decoding), "packed" (segment_starts), "context_parallel".
REFUSALS = {
    "dar_latent": {
        "context_parallel": (NotImplementedError, "read with the queries' unrotated part"),
    },
    "aamoe": {
        "packed": (ValueError, "aamoe does not take segment_starts .* its budget is shared by the whole sequence"),
        "context_parallel": (NotImplementedError, "within a budget set over the whole sequence"),
    },
    "all_attention": {
        "context_parallel": (NotImplementedError, "persistent memory slots are keys outside the sequence"),
    },
}

# kind -> f(model): puts a model in the mode its cached decoding computes, where that is not the default
# (AA-MoE's cache always takes the budgets of its causal predictor; the full forward, by default, the
# whole sequence's).
CAUSAL_MODE = {
    "aamoe": lambda model: set_budget_source(model, "predictor"),
}

# kind -> a config of the kind that computes plain causal attention (windows and blocks past any length up
# to 64, AHA's gates all open at its default "global" router init, DAR's bottleneck at full width). Kinds
# without one (All-Attention and AA-MoE replace the MLP) are not listed.
FULL_EQUIVALENT = {
    "full": FullConfig(),
    "sliding": SlidingConfig(window=64),
    "aha": AHAConfig(window=8),
    "dar": DARConfig(window=8, d_down=32),  # d_down = d_model of the contract's model
    "sinks": SinksConfig(window=64, n_sinks=2),
    "dilated": DilatedConfig(window=64, dilation=1),
    "longformer": LongformerConfig(window=64, global_first=2),
    "bigbird": BigBirdConfig(block=8, window_blocks=8, global_blocks=1, random_blocks=1),
}


def builtin_kinds():
    """The kinds the package registers (tests may register more)."""
    return [k for k in registry.kinds() if registry.get(k).module.__module__.startswith("allhere.")]


def contract_cases():
    """Every built-in kind and every variant (``VARIANTS``): what the contract tests run."""
    return builtin_kinds() + sorted(VARIANTS)


def example(kind):
    """The example config of ``kind`` (or of a variant, ``VARIANTS``); fails the calling test when the kind has
    none."""
    if kind in VARIANTS:
        return VARIANTS[kind]
    if kind not in EXAMPLES:
        pytest.fail(f"mechanism kind {kind!r} has no example config: add one to tests/mechanism_examples.py")
    return EXAMPLES[kind]


def refusal(kind, item):
    """``pytest.raises`` for the refusal ``kind`` declares for contract ``item``, or None."""
    declared = REFUSALS.get(kind, {}).get(item)
    return None if declared is None else pytest.raises(declared[0], match=declared[1])
