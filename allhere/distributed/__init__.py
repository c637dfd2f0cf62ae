"""Scale-out with torch's own distributed stack: data-parallel FSDP2 training with sharded
(``torch.distributed.checkpoint``) checkpoints, and ring attention (context parallelism) that skips
the blocks a mask pattern never reads, and context-parallel runs of a ``Decoder`` through that ring
(``context_parallel``); ``ParallelConfig``, the dp x cp mesh of a training run. ``docs/scale-out.md`` has the
how-to."""

from .context import ContextParallel, ShardBatch, context_parallel, context_parallel_loss, shard_batch, shard_loss
from .layouts import LAYOUTS, positions, shard, unshard
from .parallel import ParallelConfig
from .ring import RingStats, ring_aha_attention, ring_attention, ring_gated_attention
from .ring_blocks import Pattern, causal, pattern_from, sliding
from .ring_plan import RingSpec, make_plan

__all__ = ["LAYOUTS", "ContextParallel", "ParallelConfig", "Pattern", "RingSpec", "RingStats", "ShardBatch", "causal",
           "context_parallel", "context_parallel_loss", "make_plan", "pattern_from", "positions", "ring_aha_attention",
           "ring_attention", "ring_gated_attention", "shard", "shard_batch", "shard_loss", "sliding", "unshard"]
