"""A KV cache group of allhere's own in vLLM: attention sinks (StreamingLLM, "Efficient Streaming Language Models
with Attention Sinks", arXiv:2309.17453) keep a constant number of blocks per request, the sink blocks pinned and
the window's blocks sliding, as vLLM's own sliding-window layers do for a plain window.

- ``SinkWindowSpec``: vLLM's ``SlidingWindowSpec`` plus ``n_sinks``; a layer reporting it gets its own cache
  group (uniform only with the same window and sinks), sized for the window, the step's tokens and the sink
  blocks.
- ``SinkWindowManager``: vLLM's ``SlidingWindowManager`` that frees only the blocks between the sinks and the
  window, as vLLM's R-SWA manager frees a gap: blocks ``[cdiv(n_sinks, bs), (n - w + 1) // bs)`` once n tokens
  are processed (the next query, at position n, reads keys ``j > n - w`` and ``j < n_sinks``). A prefix-cache
  hit is the sliding window's hit with the sink blocks taken from the cache too (no hit if one is gone).
- ``SinkAttention``: a vLLM ``Attention`` whose only change is the spec it reports (vLLM's ``RSWAAttention``
  is the same pattern); allhere's attention (``allhere.serve.vllm.attention``) reads its cache and never touches
  a freed block: the sinks' mask excludes every block of the gap, and the block test skips them.

Registered in vLLM's public KV spec registry when this module is imported: by the worker through
``allhere.serve.vllm.install``, by the engine core when it unpickles the workers' specs. Needs vLLM's hybrid KV
cache manager (``allhere.serve.vllm.install.install`` refuses sinks without it: their ``Serving.own_cache_group``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.attention import Attention
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager, register_all_kvcache_specs
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .cpu_kernels import VLLM_WINDOW_OFFSET


@dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(SlidingWindowSpec):
    n_sinks: int  # the first tokens every query reads, their blocks kept for the whole request

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        return (super().max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
                + cdiv(self.n_sinks, self.block_size))

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(type(s) is SinkWindowSpec and s.sliding_window == self.sliding_window
                   and s.n_sinks == self.n_sinks for s in kv_cache_specs.values())


class SinkWindowManager(SlidingWindowManager):
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0  # vLLM's allocation reads "skipped" as a prefix: the sinks are not one

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        first_read = processed_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens
        self._remove_blocks_in_range(request_id, cdiv(self.kv_cache_spec.n_sinks, self.block_size),
                                     max(0, first_read) // self.block_size)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        hit, length = super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
            alignment_tokens, dcp_world_size, pcp_world_size)
        bs = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, bs, alignment_tokens=alignment_tokens,
                                      supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup)
        for i in range(min(cdiv(kv_cache_spec.n_sinks, bs), len(hit[0]))):
            if hit[0][i].is_null:  # the window's hit left it out: the sink block must still be cached
                cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
                if cached is None:
                    return tuple([] for _ in kv_cache_group_ids), 0
                for blocks, block in zip(hit, cached):
                    blocks[i] = block
        return hit, length

    @classmethod
    def reachable_block_mask(cls, *args, **kwargs):
        return None  # every full block may serve a hit (the sink blocks above all)


class SinkAttention(Attention):
    """vLLM's ``Attention`` reporting ``SinkWindowSpec`` (window ``window`` as allhere counts it, ``n_sinks``)."""

    def __init__(self, *args, window: int, n_sinks: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.allhere_window, self.allhere_sinks = window, n_sinks

    def get_kv_cache_spec(self, vllm_config) -> KVCacheSpec | None:
        spec = super().get_kv_cache_spec(vllm_config)
        if spec is None:
            return None
        base = {f.name: getattr(spec, f.name) for f in fields(AttentionSpec)}
        return SinkWindowSpec(**base, sliding_window=self.allhere_window + VLLM_WINDOW_OFFSET,
                              n_sinks=self.allhere_sinks)


def register() -> None:
    """vLLM's built-in specs first (its registry fills itself only while it is empty; registering the same
    again is allowed), then ours."""
    register_all_kvcache_specs(get_current_vllm_config_or_none())
    KVCacheSpecRegistry.register(SinkWindowSpec, SinkWindowManager, uniform_type_base_spec=SinkWindowSpec)


register()
