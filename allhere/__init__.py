"""allhere: local and global attention for decoder-only language models.

Importing the package needs only torch; plotting, Hugging Face and Triton pieces load where used.
"""

from ._deprecated import moved_names
from .backend import use_backend
from .config import ModelConfig, TrainConfig
from .mechanisms import (
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
    bigbird_schedule,
    dilation_schedule,
)
from .model import Decoder, DecoderOutput, swap_mechanism
from .ops.aha import aha_attention, aha_attention_reference
from .ops.sliding import sliding_window_attention, sliding_window_attention_reference
from .registry import Serving, register
from .routing import LayerRouting, Routing, routed_layers, set_forced_gate
from .validation import ConfigError

__version__ = "0.1.0"

__all__ = [
    "AAMoEConfig", "AHAConfig", "AllAttentionConfig", "BigBirdConfig", "ConfigError", "DARConfig", "DARLatentConfig",
    "DilatedConfig",
    "LongformerConfig", "Serving", "SinksConfig", "bigbird_schedule", "dilation_schedule", "Decoder", "DecoderOutput",
    "FullConfig", "LayerRouting", "ModelConfig", "Routing", "SlidingConfig", "TrainConfig", "aha_attention",
    "aha_attention_reference", "register", "routed_layers", "set_forced_gate", "sliding_window_attention",
    "sliding_window_attention_reference", "swap_mechanism", "use_backend",
]

__getattr__ = moved_names(__name__, {
    "aha_attention_naive": ("allhere.ops.aha", "aha_attention_reference"),
    "sliding_window_attention_naive": ("allhere.ops.sliding", "sliding_window_attention_reference"),
})
