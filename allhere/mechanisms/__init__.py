"""The built-in attention mechanisms; importing this package registers them (``allhere.registry``)."""

from .aamoe import AAMoEAttention, AAMoEConfig
from .aha import AHAAttention, AHAConfig
from .allattention import AllAttention, AllAttentionConfig
from .base import AttentionCall, AttentionDims, AttentionMechanism, ContextParallelPlan, mechanism_layers
from .bigbird import BigBirdAttention, BigBirdConfig, bigbird_schedule
from .dar import DARAttention, DARConfig
from .dar_latent import DARLatentAttention, DARLatentConfig
from .dilated import DilatedAttention, DilatedConfig, dilation_schedule
from .full import FullAttention, FullConfig
from .longformer import LongformerAttention, LongformerConfig
from .sinks import SinksAttention, SinksConfig
from .sliding import SlidingAttention, SlidingConfig

__all__ = ["AAMoEAttention", "AAMoEConfig", "AHAAttention", "AHAConfig", "AllAttention", "AllAttentionConfig",
           "AttentionCall", "AttentionDims", "AttentionMechanism", "BigBirdAttention",
           "BigBirdConfig", "ContextParallelPlan", "DARAttention", "DARConfig", "DARLatentAttention", "DARLatentConfig",
           "DilatedAttention", "DilatedConfig",
           "FullAttention", "FullConfig", "LongformerAttention", "LongformerConfig", "SinksAttention", "SinksConfig",
           "SlidingAttention", "SlidingConfig", "bigbird_schedule", "dilation_schedule", "mechanism_layers"]
