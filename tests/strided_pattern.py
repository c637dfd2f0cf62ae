"""A masked pattern defined outside allhere, for the tests: a causal window plus every ``stride``-th key. It is
registered with ``serving=Serving("masked")`` and nothing else, and allhere's vLLM plugin serves it as it serves
the built-in patterns, with nothing in ``allhere.serve`` naming it (tests/serve). Imported by the tests that
use it, not at collection: the registry is the process's."""

from dataclasses import dataclass, field

from allhere import Serving, register
from allhere.masks import Mask, causal
from allhere.mechanisms.masked_base import PatternAttention


@dataclass(frozen=True)
class StridedConfig:
    """Query i reads keys j <= i with i - j < window, and every key j with j % stride == 0."""

    window: int = 8
    stride: int = 5
    kind: str = field(default="strided_test", init=False)

    def mask_fn(self, n: int | None = None, layer: int | None = None):
        window, stride = self.window, self.stride

        def pred(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & ((q_idx - kv_idx < window) | (kv_idx % stride == 0))

        # tiles: a superset, any causal rectangle may hold a strided key
        return Mask(pred, tiles=causal.tiles, name=f"strided_{window}_{stride}")


@register(StridedConfig, summary="a window plus every stride-th key (a test mechanism)", serving=Serving("masked"))
class StridedAttention(PatternAttention):
    pass
