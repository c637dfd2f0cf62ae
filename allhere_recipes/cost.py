"""Cost model of ring attention per rank: rounds, bytes sent and received, attention FLOPs, activation
memory. Computed from the same ``RingPlan`` that the ring executes (``ring_plan.py``), counting what
``ring.py`` does with it -- a test checks it against the ring's own counters (``RingStats``).

Counted as the ring does them: forward -- key/value chunks in the input dtype, 4 * rows * keys * dim
FLOPs per (batch, head) and block (Q K^T and P V); backward -- the key/value chunks again, dK/dV sent
back in fp32, 10 * rows * keys * dim FLOPs (S, dP, dV, dQ, dK). Saved for the backward per layer: this
rank's q, k, v, output (input dtype), log-sum-exp (fp32) and, for AHA, the bool gate. The working
peak of the forward adds the fp32 accumulators, the concatenated K/V, two in-flight receive buffers
and one block's scores and probabilities (fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from allhere.distributed.layouts import chunks_per_rank
from allhere.distributed.ring_blocks import causal, sliding
from allhere.distributed.ring_plan import RingPlan, RingSpec, make_plan

PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Shape:
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    elt: int = 2  # bytes per element of q, k, v (2: bf16)


def ring_cost(plan: RingPlan, shape: Shape, rank: int, backward: bool = True) -> dict:
    """Counters of one ring pass on ``rank``, in ``RingStats.counts``' layout."""
    s, c = shape, plan.chunk
    kv_chunk = s.batch * s.kv_heads * c * 2 * s.head_dim  # elements of one K+V chunk
    out = {p: dict(rounds=0, transfers=0, bytes_sent=0, bytes_received=0, flops=0) for p in PHASES}
    for t in range(plan.world):
        blocks = plan.blocks(rank, t)
        mine = len(plan.needed(rank, t)) if t else 0
        theirs = len(plan.needed(plan.dst(rank, t), t)) if t else 0
        work = sum(s.batch * s.heads * plan.rows(rank, b) * c * s.head_dim for b in blocks)
        for phase, mult in (("forward", 4), ("backward", 10)):
            if phase == "backward" and not backward:
                continue
            o = out[phase]
            o["rounds"] += bool(blocks)
            o["transfers"] += bool(mine)
            o["bytes_received"] += mine * kv_chunk * s.elt
            o["bytes_sent"] += theirs * kv_chunk * s.elt
            o["flops"] += mult * work
            if phase == "backward":  # dK/dV travel back to the owners, in fp32
                o["bytes_sent"] += mine * kv_chunk * 4
                o["bytes_received"] += theirs * kv_chunk * 4
    return out


def add(a: dict, b: dict) -> dict:
    return {p: {k: a[p][k] + b[p][k] for k in a[p]} for p in PHASES}


def saved_bytes(shape: Shape, n: int, world: int, selector: bool = False, trained_gate: bool = False) -> int:
    """Bytes one attention layer keeps for the backward on each rank (a trained AHA gate adds the
    difference a_full - a_local that its straight-through gradient multiplies, output-sized)."""
    s, local = shape, n // world
    qo = 2 * s.batch * s.heads * local * s.head_dim * s.elt
    kv = 2 * s.batch * s.kv_heads * local * s.head_dim * s.elt
    lse = s.batch * s.heads * local * 4
    diff = s.batch * s.heads * local * s.head_dim * s.elt if trained_gate else 0
    return qo + kv + lse + (s.batch * s.heads * local if selector else 0) + diff


def working_peak_bytes(plan: RingPlan, shape: Shape, rank: int) -> int:
    """Forward working set of one layer on ``rank`` beyond its inputs (see the module docstring)."""
    s, c, local = shape, plan.chunk, plan.n // plan.world
    acc = s.batch * s.heads * local * (s.head_dim + 1) * 4
    kv = s.batch * s.kv_heads * local * 2 * s.head_dim * s.elt
    chunk_kv = s.batch * s.kv_heads * c * 2 * s.head_dim * s.elt
    bufs = max((len(plan.needed(rank, t)) for t in range(1, plan.world)), default=0) * chunk_kv * 2
    return acc + kv + bufs + score_bytes(shape, c)


def score_bytes(shape: Shape, chunk: int) -> int:
    """One block's fp32 scores and probabilities (per batch and head): the part of the working set a
    flash kernel per block would not hold."""
    return 2 * shape.batch * shape.heads * chunk * chunk * 4


def plan_for(mechanism: str, n: int, world: int, layout: str, window: int = 4096, mu_f: float = 0.07,
             is_global=None) -> tuple[RingPlan, bool]:
    """(plan, has selector) of a mechanism: "full", "sliding", "longformer" (window + global tokens
    ``is_global``) or "aha" (a share mu_f of each chunk's rows global in every (batch, head), spread
    evenly -- the model's assumption; a real gate's counts go in through ``make_plan``)."""
    if mechanism == "full":
        return make_plan(RingSpec(causal()), n, world, layout), False
    if mechanism == "sliding":
        return make_plan(RingSpec(sliding(window)), n, world, layout), False
    if mechanism == "longformer":
        from allhere import masks
        from allhere.distributed.ring_blocks import pattern_from

        return make_plan(RingSpec(pattern_from(masks.longformer(window, is_global))), n, world, layout), False
    if mechanism == "aha":
        c = n // (world * chunks_per_rank(layout))
        rows = [[math.ceil(mu_f * c)] * chunks_per_rank(layout) for _ in range(world)]
        return make_plan(RingSpec(causal(), sliding(window)), n, world, layout, rows), True
    raise ValueError(f"unknown mechanism {mechanism!r}")


def aha_training_extra(n: int, world: int, layout: str, window: int, shape: Shape, rank: int) -> dict:
    """The two forward-only passes a trained AHA gate adds (full causal and the window, for the
    straight-through gradient a_full - a_local of every row)."""
    full = ring_cost(make_plan(RingSpec(causal()), n, world, layout), shape, rank, backward=False)
    local = ring_cost(make_plan(RingSpec(sliding(window)), n, world, layout), shape, rank, backward=False)
    return add(full, local)


def mechanism_plan(mechanism: str, n: int, world: int, layout: str, shape: Shape, window: int = 4096,
                   mu_f: float = 0.07, n_global: int = 64):
    """(plan, has selector, extra passes or None) of a mechanism as the tables name it: ``plan_for``'s, or
    "aha (gate trained)" (AHA plus ``aha_training_extra``); Longformer's global tokens are the first
    ``n_global``."""
    is_global = torch.zeros(n, dtype=torch.bool)
    is_global[:n_global] = True
    plan, selector = plan_for(mechanism.split()[0], n, world, layout, window=window, mu_f=mu_f, is_global=is_global)
    extra = (lambda r: aha_training_extra(n, world, layout, window, shape, r)) if "trained" in mechanism else None
    return plan, selector, extra


def summary(plan: RingPlan, shape: Shape, selector: bool, extra=None) -> dict:
    """The busiest rank's numbers of one layer, forward + backward (``extra(rank)``: more passes); also the
    forward alone (``fwd_sent``, ``fwd_received``, ``fwd_flops``: what a recompute runs again), the rounds
    that receive anything in both passes (``transfers``) and one block's score bytes (``score_blocks``)."""
    per_rank = []
    for r in range(plan.world):
        cst = ring_cost(plan, shape, r)
        if extra is not None:
            cst = add(cst, extra(r))
        fwd = cst["forward"]
        per_rank.append(dict(rounds=fwd["rounds"],
                             received=sum(cst[p]["bytes_received"] for p in PHASES),
                             sent=sum(cst[p]["bytes_sent"] for p in PHASES),
                             flops=sum(cst[p]["flops"] for p in PHASES),
                             peak=working_peak_bytes(plan, shape, r),
                             fwd_sent=fwd["bytes_sent"], fwd_received=fwd["bytes_received"], fwd_flops=fwd["flops"],
                             transfers=sum(cst[p]["transfers"] for p in PHASES)))
    out = {k: max(p[k] for p in per_rank) for k in per_rank[0]}
    out["saved"] = saved_bytes(shape, plan.n, plan.world, selector)
    out["score_blocks"] = score_bytes(shape, plan.chunk)
    return out
