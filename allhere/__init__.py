"""allhere: local and global attention for decoder-only language models.

Importing the package needs only torch; plotting, Hugging Face and Triton pieces load where used.
"""

from .config import AHAConfig, ConfigError, DARConfig, FullConfig, ModelConfig, SlidingConfig
from .model import Decoder, DecoderOutput, set_aha_impl, set_forced_gate, swap_mechanism
from .ops.aha import aha_attention_fast, aha_attention_naive
from .ops.sliding import sliding_window_attention, sliding_window_attention_naive
from .routing import LayerRouting, Routing

aha_attention = aha_attention_fast

__version__ = "0.1.0"

__all__ = [
    "AHAConfig", "ConfigError", "DARConfig", "Decoder", "DecoderOutput", "FullConfig", "LayerRouting", "ModelConfig",
    "Routing", "SlidingConfig", "aha_attention", "aha_attention_fast", "aha_attention_naive",
    "set_aha_impl", "set_forced_gate", "sliding_window_attention", "sliding_window_attention_naive",
    "swap_mechanism",
]
