"""Context-parallel (sequence-sharded) runs of a model -- allhere's ``Decoder``, or a converted Hugging Face
model through ``allhere.hf.HFCausalLM`` -- where every sequence is split across the ranks of a process
group, and each layer's attention runs through the ring (``ring.py``).

    from allhere.distributed.context import context_parallel

    with context_parallel(model, group, layout="zigzag") as cp:
        ids, pos, targets = cp.shard(batch_ids)              # this rank's tokens, positions, targets
        out = model(ids, positions=pos)
        loss = cp.loss(out, targets, lam)                     # mean over ranks = the one-process loss
        loss.total.backward()                                 # then average gradients over the group

Inside the ``with`` block, each layer's mechanism runs through the ring (the module tree, parameter names
and state dict stay as they are: only the mechanisms' ``forward`` is replaced, and restored on exit). What
the ring computes is the mechanism's own declaration, ``context_parallel_plan(call, n)`` of the mechanism
interface (``allhere.mechanisms.base.ContextParallelPlan``): the mask predicates of the keys its queries
read, optionally a per-(token, head) gate between two of them (with its straight-through gradient while
the router trains; the layer's routing then covers this rank's tokens) and its own block logits.

A mechanism that cannot run so (its ``context_parallel_refusal()`` gives the reason) is refused on entry
in one line naming the layer, the mechanism and why; a KV cache raises on the call. Packed documents:
give the whole sequences' segment starts to ``cp.shard``; the ring then masks every block to them.
The ring needs every rank of the group to run the same layers in the same order, forward and backward.

Losses: the next-token target of a shard's last token lives on another shard, so ``shard_batch`` shifts
the whole sequence before sharding; ``context_parallel_loss`` weights each rank's sum so that the *mean*
over ranks of every field (total, L_LM, L_reg, mu_f) equals the one-process value. Averaging gradients over
the group (what FSDP / DDP do) therefore gives exactly the one-process gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..losses import Loss
from ..masks import and_masks, within_segments
from ..mechanisms.base import AttentionCall, mechanism_layers
from . import layouts
from .ring import RingStats, ring_attention, ring_gated_attention
from .ring_blocks import Pattern, pattern_from

IGNORE = -100  # target of a position with no next token (or masked out of the loss)


class ShardBatch(NamedTuple):
    ids: torch.Tensor  # [batch, n / world] this rank's input ids
    positions: torch.Tensor  # int64 [n / world] their absolute positions (``Decoder(positions=...)``)
    targets: torch.Tensor  # [batch, n / world] next-token ids, ``IGNORE`` where none counts


def shard_batch(ids: torch.Tensor, layout: str, rank: int, world: int,
                loss_mask: torch.Tensor | None = None) -> ShardBatch:
    """This rank's share of a batch of whole sequences ids [batch, n]: input ids, absolute positions and
    next-token targets. The targets are shifted over the *whole* sequence first (the target of a shard's
    last token is the first token of the next chunk); the sequence's last token has none (``IGNORE``).
    ``loss_mask`` [batch, n] (True = train on this target token, as in ``allhere.losses.lm_loss``) sets
    the targets it excludes to ``IGNORE``."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [batch, tokens], got shape {tuple(ids.shape)}")
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = ids[:, 1:]
    if loss_mask is not None:
        if loss_mask.shape != ids.shape:
            raise ValueError(f"loss_mask must be [batch, tokens] = {tuple(ids.shape)}, got {tuple(loss_mask.shape)}")
        keep = torch.zeros_like(ids, dtype=torch.bool)
        keep[:, :-1] = loss_mask[:, 1:].bool()
        targets = targets.masked_fill(~keep, IGNORE)
    cut = lambda x: layouts.shard(x, layout, world, rank, dim=1)  # noqa: E731
    return ShardBatch(cut(ids), layouts.positions(ids.shape[1], layout, world, rank, ids.device), cut(targets))


def context_parallel_loss(out, targets: torch.Tensor, lam: float, group=None) -> Loss:
    """``allhere.losses.training_loss`` of one rank's shard: L = L_LM + lam * L_reg, each field weighted so
    that its mean over the ranks of ``group`` equals the one-process value of the whole batch. L_LM counts
    the targets of every rank (one all-reduce of the count); L_reg and mu_f are this rank's means, exact
    because every rank holds the same number of tokens. ``out``: the model's ``DecoderOutput`` of the
    shard; ``targets``: ``shard_batch``'s."""
    world = dist.get_world_size(group)
    logits = out.logits
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} do not match the logits' [batch, tokens] "
                         f"{tuple(logits.shape[:2])}")
    count = (targets != IGNORE).sum().to(torch.float64)
    dist.all_reduce(count, group=group)
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    lm = ce * world / count.clamp_min(1.0).to(ce.dtype)
    aux = 0.0 if out.aux_loss is None else out.aux_loss  # this rank's; the gradient average takes the mean
    if out.routing is None:
        return Loss(lm + aux, lm, None, None)
    l_reg = out.routing.l_reg()
    return Loss(lm + lam * l_reg + aux, lm, l_reg, out.routing.mu_f().detach())


def mean_over_ranks(x: torch.Tensor | float, group=None) -> float:
    """The mean of a per-rank value over ``group`` (e.g. a ``context_parallel_loss`` field for logging)."""
    device = x.device if isinstance(x, torch.Tensor) else "cpu"  # an NCCL-only group takes CUDA tensors alone
    t = torch.tensor(float(x.detach()) if isinstance(x, torch.Tensor) else float(x), dtype=torch.float64,
                     device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


# -- the mechanisms under the ring ----------------------------------------------------------------------------


def check_supported(model: torch.nn.Module) -> None:
    """Raise ``NotImplementedError`` (one line) naming every layer whose mechanism cannot run context-parallel
    (its class, its config's kind and its ``context_parallel_refusal()``), and what the model itself says
    (a host's own ``context_parallel_refusal()``, e.g. a Hugging Face model with layers left unconverted)."""
    bad = [f"layer {i}: {type(m).__name__} ({getattr(m.cfg, 'kind', '?')}): {why}"
           for i, m in enumerate(mechanism_layers(model)) if (why := m.context_parallel_refusal()) is not None]
    if not mechanism_layers(model):
        bad.append("it has no attention mechanism to run through the ring (convert it first)")
    host = getattr(model, "context_parallel_refusal", None)
    if host is not None and (why := host()) is not None:
        bad.insert(0, f"{type(model).__name__}: {why}")
    if bad:
        raise NotImplementedError("context parallelism cannot run " + "; ".join(bad))


@dataclass
class _RingForward:
    """The ``forward`` a mechanism runs under ``context_parallel``: the same contract (q [b, h, n/d, dim],
    k, v [b, kv_heads, n/d, dim] of this rank's shard -> (out, routing or None)), through the ring under
    the mechanism's ``context_parallel_plan``."""

    mech: torch.nn.Module
    cp: "ContextParallel"

    def __call__(self, q, k, v, call: AttentionCall, cache=None):
        name = type(self.mech).__name__
        if cache is not None:
            raise NotImplementedError(f"{name} under context parallelism: a KV cache is not supported (decode "
                                      "without context_parallel)")
        if call.segment_starts is not None:
            raise NotImplementedError(f"{name} under context parallelism: pass segment starts (padding, packed "
                                      "documents) to cp.shard, not to the model")
        if call.attend is not None:
            raise NotImplementedError(f"{name} under context parallelism: a host softmax with terms of its own "
                                      "(sinks, soft-capping) is not supported")
        cp = self.cp
        plan = self.mech.context_parallel_plan(call, q.shape[2] * cp.world)
        kw = dict(group=cp.group, layout=cp.layout, scale=call.scale, stats=cp.stats, scores=plan.scores)
        within = lambda p: None if p is None else cp.within_segments(p, q.shape[0], q.shape[1])  # noqa: E731
        if plan.far is not None:  # distant keys that travel in a compact form (DAR's latents)
            from .ring_far import ring_far_attention

            far = dataclasses.replace(plan.far, near=within(plan.far.near))
            if cp.segments is not None and cp.rope_restarts_at_segments:  # expand at the rotary positions
                far.expand = lambda c, pos, f=far.expand, s=cp.segments: f(c, pos - s[:, pos])
            plan = dataclasses.replace(plan, reads=within(plan.reads), far=far)
            return ring_far_attention(q, k, v, plan, **kw), plan.routing
        reads, local = within(plan.reads), within(plan.local)
        if plan.gate is None:
            return ring_attention(q, k, v, reads, **kw), plan.routing
        if local is None:
            raise ValueError(f"{name}.context_parallel_plan gave a gate without the local predicate")
        return ring_gated_attention(q, k, v, plan.gate, reads, local, **kw), plan.routing


@dataclass
class ContextParallel:
    """What ``context_parallel`` yields: the group's geometry and the shard / loss helpers bound to it."""

    group: object
    layout: str
    rank: int
    world: int
    stats: RingStats | None = None
    # int64 [batch, n]: the segment starts of the whole sequences now sharded (``cp.shard``), or None
    segments: torch.Tensor | None = None
    # whether the model's rotary positions restart with every document (``rope_restarts_at_segments``)
    rope_restarts_at_segments: bool = False

    def shard(self, ids: torch.Tensor, loss_mask: torch.Tensor | None = None,
              segment_starts: torch.Tensor | None = None) -> ShardBatch:
        """This rank's share of ids [batch, n] (``shard_batch``). ``segment_starts`` [batch, n] of the whole
        sequences (``allhere.masks.starts_from``: packed documents, padding) are kept for the ring, which
        then masks every block to its segments, until the next ``shard``; take this rank's part of them
        with ``cp.cut(segment_starts)`` where the model needs it (e.g. positions that restart per document)."""
        if segment_starts is not None and segment_starts.shape != ids.shape:
            raise ValueError(f"segment_starts must be [batch, tokens] = {tuple(ids.shape)}, got "
                             f"{tuple(segment_starts.shape)}")
        self.segments = segment_starts
        return shard_batch(ids, self.layout, self.rank, self.world, loss_mask)

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a [batch, n] tensor of whole sequences."""
        return layouts.shard(x, self.layout, self.world, self.rank, dim=1)

    def within_segments(self, pred, batch: int, heads: int) -> Pattern:
        """``pred`` (a predicate or ``Pattern``) restricted to the segments of the batch being run; blocks are
        still skipped by ``pred``'s own test (a segment only removes scores, and every rank must agree)."""
        pattern = pattern_from(pred, batch=batch, heads=heads)
        if self.segments is None:
            return pattern
        if self.segments.shape[0] != batch:
            raise ValueError(f"the segment starts given to cp.shard are for {self.segments.shape[0]} sequences, the "
                             f"layer runs {batch}")
        return Pattern(f"{pattern.name}_in_segments", and_masks(pattern.pred, within_segments(self.segments)),
                       pattern.block_kept, batch, pattern.heads)

    def loss(self, out, targets: torch.Tensor, lam: float) -> Loss:
        return context_parallel_loss(out, targets, lam, self.group)


@contextlib.contextmanager
def context_parallel(model: torch.nn.Module, group=None, layout: str = "zigzag",
                     stats: RingStats | None = None) -> Iterator[ContextParallel]:
    """Run ``model``'s attention layers through the ring over ``group`` (default: the world) while the
    block is open; yields a ``ContextParallel``. Call the model on a shard (``cp.shard``) with its absolute
    ``positions``; every rank of the group must make the same calls. ``stats`` collects the ring's
    counters over every layer. Raises ``NotImplementedError`` for a mechanism without a ring counterpart
    (nothing is changed then)."""
    layouts.check_layout(layout)
    check_supported(model)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel needs an initialised torch.distributed process group")
    mechs = mechanism_layers(model)
    if any("forward" in vars(m) for m in mechs):
        raise RuntimeError("context_parallel is already active on this model")
    hook = model.register_forward_pre_hook(_require_positions, with_kwargs=True)  # a shard needs its positions
    cp = ContextParallel(group, layout, dist.get_rank(group), dist.get_world_size(group), stats,
                         rope_restarts_at_segments=getattr(model, "rope_restarts_at_segments", False))
    try:
        for m in mechs:
            m.forward = _RingForward(m, cp)
        yield cp
    finally:
        for m in mechs:
            vars(m).pop("forward", None)
        hook.remove()


def _require_positions(module, args, kwargs):
    if kwargs.get("positions") is None:
        raise ValueError("under context_parallel, call the model with positions= (the shard's absolute "
                         "positions, from cp.shard / shard_batch): otherwise its rotary angles are wrong")
    if kwargs.get("cache") is not None or len(args) > 1:
        raise NotImplementedError("under context_parallel, call the model as model(ids, positions=...): no KV "
                                  "cache, no other positional arguments")
    return None


def shard_loss(model: torch.nn.Module, ids: torch.Tensor, lam: float, layout: str, loss_mask=None, autocast=None,
               group=None, segment_starts: torch.Tensor | None = None) -> Loss:
    """One micro-batch of context-parallel training: the forward pass of this rank's shard of ids [batch, n]
    under ``context_parallel`` and its ``context_parallel_loss`` (mean over ranks = the one-process loss);
    backpropagate ``total`` on every rank of the group, then average the gradients over it.

    ``segment_starts`` [batch, n] (packed documents) restrict every layer's attention to its document, as
    in one process; a model whose positions restart with every document (``rope_restarts_at_segments``:
    Hugging Face models trained on packed data) also gets this rank's part of them. Padding (starts -1) is
    refused: its tokens would count in L_reg here, not in one process."""
    if segment_starts is not None and bool((segment_starts < 0).any()):
        raise NotImplementedError("context parallelism takes packed documents, not padding (segment starts -1)")
    with context_parallel(model, group, layout) as cp:
        ids, pos, targets = cp.shard(ids, loss_mask, segment_starts)
        kwargs = {}
        if segment_starts is not None and cp.rope_restarts_at_segments:
            kwargs["segment_starts"] = cp.cut(segment_starts)
        with autocast if autocast is not None else contextlib.nullcontext():
            out = model(ids, positions=pos, **kwargs)
        return cp.loss(out, targets, lam)
