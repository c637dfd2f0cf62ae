"""The packing of AHA's global queries for the global kernels, on the device and without a host sync: per
(batch, head) its global positions in increasing order and a running count (``pack_global``), and the order
in which the blocks of those positions start (``longest_first``; ``work_order`` keeps it to long sequences).

Each is one Triton launch (plus the sort of the blocks by reach): on a GPU a prefill call's host work is
mostly its launches, and the same steps in torch took about 25 small ops. ``pack_global_torch`` and
``longest_first_torch`` compute the same in torch; they are the references the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # positions (pack) or blocks (reach) a program handles per step of its loop
# From this length on, the global blocks start longest first (a launch and a sort); shorter sequences take a
# fixed order, each head's last block first, which costs nothing: their blocks read few keys, so a long one
# left to the end adds little, less than the sort costs the host.
SORT_FROM = 8192


@triton.jit
def _pack_kernel(HARD, ROWS, CUM, N, CHUNK: tl.constexpr):
    """One (batch, head) per program: its positions in chunks, a running count of its global ones."""
    bh = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    seen = tl.sum(tl.zeros([CHUNK], tl.int32), 0)  # an int32 scalar carried by the loop
    for start in range(0, N, CHUNK):
        pos = start + offs
        inside = pos < N
        g = (tl.load(HARD + bh * N + pos, mask=inside, other=0) != 0).to(tl.int32)
        count = tl.cumsum(g, 0) + seen
        tl.store(CUM + bh * N + pos, count, mask=inside)
        tl.store(ROWS + bh * (N + 1) + count - 1, pos.to(tl.int32), mask=inside & (g > 0))  # its rank
        seen += tl.sum(g, 0)


@triton.jit
def _reach_kernel(ROWS, CUM, REACH, N, PER_HEAD, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """One (batch, head) per program: per block of BLOCK_M of its packed positions, the last one (-1 for a
    block past its count)."""
    bh = tl.program_id(0).to(tl.int64)
    count = tl.load(CUM + bh * N + N - 1)
    offs = tl.arange(0, CHUNK)
    for j0 in range(0, PER_HEAD, CHUNK):
        j = j0 + offs
        mine = j < PER_HEAD
        live = j * BLOCK_M < count
        last = tl.minimum((j + 1) * BLOCK_M, count) - 1
        reach = tl.load(ROWS + bh * (N + 1) + last, mask=mine & live, other=-1)
        tl.store(REACH + bh * PER_HEAD + j, reach, mask=mine)


def pack_global(hard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cum) of a [b, h, n] bool gate: rows [b * h, n + 1] int32, each (batch, head)'s global positions
    in increasing order (the entries past its count are not written: the kernels never read them); cum
    [b * h, n] int32, how many of its queries up to each position are global (the last column is its
    count). One launch."""
    b, h, n = hard.shape
    flat = hard.reshape(b * h, n).contiguous()  # the kernel reads rows of n (a copy only for odd strides)
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat  # the same bytes: no copy
    rows = torch.empty(b * h, n + 1, device=hard.device, dtype=torch.int32)
    cum = torch.empty(b * h, n, device=hard.device, dtype=torch.int32)
    if b * h and n:
        _pack_kernel[(b * h,)](flat, rows, cum, n, CHUNK=CHUNK)
    return rows, cum


def longest_first(rows: torch.Tensor, cum: torch.Tensor, block_m: int) -> torch.Tensor:
    """The global kernel's work items in the order they should start: every (batch * heads + head, block of
    ``block_m`` of its packed queries) as one int64 (bh * blocks per head + block), the block whose last
    query is latest (the most keys to read) first, across all heads, and the empty blocks (past a head's
    count) last, where they return at once. A long block started last would run on alone after the rest
    (the tail of the launch). One launch and a sort (its int64 indices as they come: no conversion)."""
    bhs, n = cum.shape
    per_head = triton.cdiv(n, block_m)
    reach = torch.empty(bhs, per_head, device=cum.device, dtype=torch.int32)
    if bhs and n:
        _reach_kernel[(bhs,)](rows, cum, reach, n, per_head, BLOCK_M=block_m, CHUNK=CHUNK)
    return torch.argsort(reach.flatten(), descending=True, stable=True)


def work_order(rows: torch.Tensor, cum: torch.Tensor, block_m: int) -> tuple[torch.Tensor | None, int]:
    """(ORDER, programs) of a global kernel over the packed queries (``pack_global``) in blocks of ``block_m``:
    ORDER from ``longest_first`` for a sequence of ``SORT_FROM`` positions or more, else None (the kernel
    then takes the fixed order: ``packed_block``); programs: one per (batch * heads, block) a head could have."""
    bhs, n = cum.shape
    programs = bhs * triton.cdiv(n, block_m)
    return (longest_first(rows, cum, block_m) if n >= SORT_FROM else None), programs


def pack_global_torch(hard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_global`` in torch ops (rows past a head's count: 0, and the last column holds junk)."""
    b, h, n = hard.shape
    flat = hard.reshape(b * h, n).to(torch.bool)
    cum = flat.cumsum(1, dtype=torch.int32)
    slot = torch.where(flat, cum - 1, n).long()  # local queries all go to the unused column n
    positions = torch.arange(n, device=hard.device, dtype=torch.int32).expand(b * h, n)
    rows = torch.zeros(b * h, n + 1, device=hard.device, dtype=torch.int32).scatter_(1, slot, positions)
    return rows, cum


def longest_first_torch(rows: torch.Tensor, cum: torch.Tensor, block_m: int) -> torch.Tensor:
    """``longest_first`` in torch ops."""
    bhs, n = cum.shape
    per_head = triton.cdiv(n, block_m)
    count = cum[:, -1:].long()  # [bh, 1]
    last_row = torch.arange(1, per_head + 1, device=cum.device) * block_m - 1  # [per_head]
    last_row = torch.minimum(last_row, count - 1)  # the block's last packed query (below its first: empty)
    empty = last_row < torch.arange(per_head, device=cum.device) * block_m
    reach = torch.where(empty, -1, rows.gather(1, last_row.clamp(min=0)).long())  # its position: the keys it reads
    return torch.argsort(reach.flatten(), descending=True, stable=True)
