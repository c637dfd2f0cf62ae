"""The base of the sparse-pattern mechanisms (``sinks``, ``dilated``, ``longformer``, ``bigbird``): one forward
pass for any mask predicate, with the KV cache, segment boundaries and grouped-query heads."""

from __future__ import annotations

import torch

from ..backend import dispatch
from ..masks import Mask, and_masks, as_mask, within_segments
from ..ops.blocksparse import BlockPlan, blocksparse_attention, plan_blocks
from ..ops.families import register_patterns
from ..ops.full import full_attention_reference, masked_attention
from ..validation import ConfigError, check, check_int
from .base import AttentionCall, AttentionMechanism, ContextParallelPlan
from .block_cache import BlockCache

BACKEND_GONE = ("PatternAttention.backend is gone: choose the path with allhere.use_backend('torch' | 'flex' | "
                "'reference')")


def _kv_with_positions(cache, k, v, positions=None):
    """Add k, v to the cache; return (keys, values, key positions) where positions is the absolute position
    of the first key (an int: contiguous keys) or an int64 tensor [keys] (a cache that drops keys in the
    middle, ``PatternKVCache``, or the given ``positions`` of a shard of a longer sequence)."""
    if cache is None:
        pos = positions
    elif hasattr(cache, "update_at"):
        k, v, pos = cache.update_at(k, v)
    else:
        offset = getattr(cache, "dropped", 0)  # RollingKVCache: the first key returned
        k, v = cache.update(k, v)
        return k, v, offset
    if pos is None:
        return k, v, 0
    if pos.numel() and bool((pos[1:] - pos[:-1] == 1).all()):
        return k, v, int(pos[0])
    return k, v, pos


def check_dilation(config) -> None:
    """Validate ``config.dilation`` (a frozen config's field): an integer >= 1, or a non-empty tuple of them
    with one stride per query head (a JSON list becomes a tuple)."""
    c, value = type(config).__name__, config.dilation
    if isinstance(value, (list, tuple)):
        object.__setattr__(config, "dilation", tuple(value))
        check(len(value) > 0 and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value),
              c, "dilation", value, "an integer >= 1 or a non-empty tuple of them (one per query head)")
    else:
        check_int(c, "dilation", value, 1)


class PatternAttention(AttentionMechanism):
    """A mechanism that attends under a fixed mask predicate: ``mask_fn(n)`` (given by its config), at the
    positions the call gives (``AttentionCall.positions``) or those its cache counts.

    Its calls form op family ``"patterns"`` (``allhere.backend``; its paths are the methods below, handed to
    ``allhere.ops.families.register_patterns``). The "torch" path runs the block-sparse op
    (``allhere.ops.blocksparse``) or the subclass's faster op for whole sequences (``fast``); the "flex"
    path (the default on CUDA) FlexAttention (``allhere.ops.flex``: compiled for at most ``flex_shapes``
    (pattern, call shape) pairs in the process), the block-sparse op past that. On both, small calls
    (``dense_below``: decode steps) and scattered key positions (a cache that dropped keys, a shard's
    positions) run SDPA over the keys at hand. The "reference" path computes every call densely in fp32. The
    block mask or tile plan of a call is built once and shared by every layer with the same pattern
    (``BlockCache``): once in all, or once per forward with segment boundaries.
    """

    reads_all_keys = False
    tile = 64  # query / key tile of the block-sparse op
    dense_below = 1 << 16  # calls with q_len * kv_len up to this run one dense SDPA call instead
    # FlexAttention compiles again for every call shape (and after dynamo's limit of 8 runs unfused, over the
    # whole score matrix): calls with fewer queries (decode, small chunks), and new shapes once this many
    # were compiled in the process (varying lengths: evaluation, generation), take the block-sparse op.
    flex_min_queries = 128
    flex_shapes = 6
    _flex_seen: set = set()  # the (pattern, call shape) pairs compiled so far, shared by every pattern layer
    _blocks = BlockCache()  # tile plans and block masks, shared by every pattern layer of the process
    _max_plans = 8  # predicates kept per layer (one per length for a non-causal pattern)

    def __init__(self, cfg, dims) -> None:
        super().__init__(cfg, dims)
        dilation = getattr(cfg, "dilation", None)
        if isinstance(dilation, tuple) and len(dilation) != dims.n_heads:
            raise ConfigError(f"{type(cfg).__name__}.dilation = {dilation!r} is invalid: expected one dilation per "
                              f"query head ({dims.n_heads})")
        self._preds: dict = {}

    def mask_fn(self, n: int | None = None) -> Mask:
        """The config's mask (``cfg.mask_fn(n)``; a plain predicate becomes a ``Mask`` without block tests),
        built once per length (once for a causal pattern: its predicate does not depend on the length)."""
        key = None if getattr(self.cfg, "causal", True) else n
        pred = self._preds.get(key)
        if pred is None:
            if len(self._preds) >= self._max_plans:
                self._preds.clear()
            pred = self._preds[key] = as_mask(self.cfg.mask_fn(n))
        return pred

    def context_parallel_plan(self, call: AttentionCall, n: int) -> ContextParallelPlan:
        """The ring under the config's predicate at the global length n (its ``tiles`` test skips the blocks
        the pattern never reads)."""
        return ContextParallelPlan(reads=self.mask_fn(n))

    def context_parallel_refusal(self) -> str | None:
        if not hasattr(self.cfg, "mask_fn"):
            return "its config has no mask_fn predicate"
        if type(self).forward is not PatternAttention.forward:
            return "it overrides PatternAttention.forward, so its mask predicate may not be all it computes"
        return None

    def fast(self, q, k, v, scale):
        """A faster exact op for a whole sequence (no cache, no segments), or None to use the plan."""
        return None

    def _pattern_key(self, n: int) -> tuple:
        """What identifies this layer's pattern for ``BlockCache``: its type and config (equal configs give
        equal patterns; a non-causal one also depends on the length n); a layer whose config cannot be
        hashed keys on itself."""
        try:
            hash(self.cfg)
            key = (type(self), self.cfg)
        except TypeError:
            key = (self,)
        return key if getattr(self.cfg, "causal", True) else (*key, n)

    def _plan(self, pred, q, k, key_offset: int, starts) -> BlockPlan:
        b, h, lq = q.shape[:3]
        hkv, lk = k.shape[1], k.shape[2]
        key = ("plan", self._pattern_key(key_offset + lk), self.tile, b, h, hkv, lq, lk, key_offset, q.device)
        return self._blocks.get(key, lambda: plan_blocks(pred, lq, lk, heads=h, kv_heads=hkv, batch=b, block=self.tile,
                                                         key_offset=key_offset, device=q.device), starts)

    def _flex_allowed(self, q, k, kpos) -> bool:
        """Whether this call may take FlexAttention: enough queries, and a (pattern, shape) compiled before
        or room for one more."""
        key = (self.cfg, *q.shape, k.shape[1], k.shape[2], kpos if isinstance(kpos, int) else -1, q.dtype, q.device)
        if q.shape[2] < self.flex_min_queries:
            return False
        if key not in self._flex_seen:
            if len(self._flex_seen) >= self.flex_shapes:
                return False
            self._flex_seen.add(key)
        return True

    def _flex(self, pred, q, k, v, key_offset: int, scale, starts):
        from ..ops.flex import flex_block_mask, flex_pattern_attention

        b, h, lq = q.shape[:3]
        lk = k.shape[2]
        key = ("flex", self._pattern_key(key_offset + lk), b, h, lq, lk, key_offset, q.device)
        mask = self._blocks.get(key, lambda: flex_block_mask(
            pred, lq, lk, heads=h, batch=b, key_offset=key_offset, device=q.device, per_batch=starts is not None,
            per_head=pred.per_head), starts)
        return flex_pattern_attention(q, k, v, mask, scale)

    @property
    def backend(self):
        raise AttributeError(BACKEND_GONE)

    @backend.setter
    def backend(self, value):
        raise AttributeError(BACKEND_GONE)

    def forward(self, q, k, v, call: AttentionCall, cache=None):
        if cache is not None and not getattr(self.cfg, "causal", True):
            raise ValueError(f"{type(self.cfg).__name__}(causal=False) cannot decode with a KV cache: later keys "
                             "change earlier outputs")
        starts = call.segment_starts
        if starts is not None and not getattr(self.cfg, "causal", True):
            raise NotImplementedError("segment boundaries (padding, packed documents) bound keys from below only; "
                                      "with causal=False a query would read later segments")
        k, v, kpos = _kv_with_positions(cache, k, v, call.positions)
        return dispatch("patterns", self, q, k, v, kpos, starts, call.scale), None

    def _torch_path(self, q, k, v, kpos, starts, scale):
        return self._sparse(q, k, v, kpos, starts, scale, flex=False)

    def _flex_path(self, q, k, v, kpos, starts, scale):
        return self._sparse(q, k, v, kpos, starts, scale, flex=self._flex_allowed(q, k, kpos))

    def _reference_path(self, q, k, v, kpos, starts, scale):
        return full_attention_reference(q, k, v, scale, self._dense_mask(q, k, kpos, starts))

    def _sparse(self, q, k, v, kpos, starts, scale, flex: bool):
        lq, lk = q.shape[2], k.shape[2]
        if isinstance(kpos, int) and kpos == 0 and lq == lk and starts is None and not flex:
            out = self.fast(q, k, v, scale)
            if out is not None:
                return out
        if isinstance(kpos, int) and lq * lk > self.dense_below:
            n = kpos + lk  # the sequence length so far
            pred = self.mask_fn(n)
            if starts is not None:
                pred = and_masks(pred, within_segments(starts, q_offset=n - lq))
            if flex:
                return self._flex(pred, q, k, v, kpos, scale, starts)
            plan = self._plan(pred, q, k, kpos, starts)
            return blocksparse_attention(q, k, v, plan, scale)
        # Decode steps and small calls (a plan costs more than it saves), and scattered positions (kept by a
        # PatternKVCache, or given for a shard): dense over the keys at hand.
        return masked_attention(q, k, v, self._dense_mask(q, k, kpos, starts), scale)

    def _dense_mask(self, q, k, kpos, starts):
        """bool [b, h, q_len, kv_len]: the predicate at the keys' positions, within each query's segment."""
        lq, lk = q.shape[2], k.shape[2]
        if isinstance(kpos, int):
            kpos = torch.arange(kpos, kpos + lk, device=q.device)
        qpos = kpos[-lq:]  # the new tokens are the last keys
        b, h = q.shape[:2]
        mask = self.mask_fn(int(kpos.max()) + 1)(torch.arange(b, device=q.device).view(-1, 1, 1, 1),
                                                  torch.arange(h, device=q.device).view(1, -1, 1, 1),
                                                  qpos.view(1, 1, -1, 1), kpos.view(1, 1, 1, -1))
        if starts is not None:  # within each query's segment (starts are absolute positions)
            s = starts[:, None, :, None]
            mask = mask & (s >= 0) & (kpos.view(1, 1, 1, -1) >= s)
        return mask.expand(b, h, lq, lk)


register_patterns(PatternAttention._reference_path, PatternAttention._torch_path, PatternAttention._flex_path)
