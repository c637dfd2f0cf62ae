"""The built-in attention mechanisms; importing this package registers them (``allhere.registry``)."""

from .aha import AHAConfig, AHAAttention
from .base import AttentionCall, AttentionDims, AttentionMechanism, mechanism_layers
from .dar import DARAttention, DARConfig
from .full import FullAttention, FullConfig
from .sliding import SlidingAttention, SlidingConfig

__all__ = ["AHAAttention", "AHAConfig", "AttentionCall", "AttentionDims", "AttentionMechanism", "DARAttention",
           "DARConfig", "FullAttention", "FullConfig", "SlidingAttention", "SlidingConfig", "mechanism_layers"]
