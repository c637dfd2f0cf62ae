"""BigBird's block-sparse pattern ("Big Bird: Transformers for Longer Sequences", arXiv:2007.14062) as
masks: the block window, the global blocks, the seeded random blocks, and the three OR-ed."""

from __future__ import annotations

import torch

from .mask import Mask
from .predicates import check_count, or_masks
from .tables import DeviceTables, is_tracing
from .windows import sliding_window


def bigbird_window(block: int, window_blocks: int, causal: bool = True) -> Mask:
    """BigBird's block window (arXiv:2007.14062): query block i sees key blocks j with 0 <= i - j <
    ``window_blocks`` (|i - j| < window_blocks for an encoder: BigBird's 3-block window is 2), and, if causal,
    only keys at or before the query."""
    check_count("block", block, 1)
    inner = sliding_window(check_count("window_blocks", window_blocks, 1), causal=causal)
    in_window, window_tiles = inner.pred, inner.tiles  # over block indices

    def pred(b, h, q_idx, kv_idx):
        out = in_window(b, h, q_idx // block, kv_idx // block)
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        out = window_tiles(b, h, ql // block, qh // block, kl // block, kh // block)
        return out & (kl <= qh) if causal else out

    return Mask(pred, tiles, name=f"bigbird_window_{block}x{window_blocks}" + ("" if causal else "_bidir"))


def bigbird_global(block: int, global_blocks: int, causal: bool = True) -> Mask:
    """BigBird's global blocks (arXiv:2007.14062): the first ``global_blocks`` blocks see every key and are
    seen by every query (keys at or before the query if causal)."""
    check_count("block", block, 1)
    edge = block * check_count("global_blocks", global_blocks, 0)

    def pred(b, h, q_idx, kv_idx):
        out = (q_idx < edge) | (kv_idx < edge)
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        out = (ql < edge) | (kl < edge)
        return out & (kl <= qh) if causal else out

    return Mask(pred, tiles, name=f"bigbird_global_{block}x{global_blocks}" + ("" if causal else "_bidir"))


class BigBirdRandom:
    """BigBird's random blocks (arXiv:2007.14062): the predicate, block test and ``prepare`` behind
    ``bigbird_random``'s ``Mask``. Each (head, query block i) sees ``random_blocks`` key blocks drawn among
    those the window and the global blocks do not cover.

    Causal: drawn among blocks g <= j <= i - window_blocks, from a generator seeded by (seed, layer, head,
    i) alone, so a prefix of a sequence has the pattern of the whole sequence (cached decoding equals the
    full forward). Encoder: drawn among every uncovered block of the sequence, seeded by (seed, layer,
    head, i, number of blocks); ``length`` fixes the sequence length, else it is read off the largest key
    position the predicate is evaluated on (right for ``dense_mask`` of the whole sequence only). Global
    query blocks draw nothing (they see everything already).

    ``heads_per_draw``: consecutive query heads that share one draw (head h uses draw h // heads_per_draw);
    with grouped-query attention, sharing a draw per kv head lets the block-sparse op gather each kv head's
    keys once for exactly the pattern (1: a draw per query head, as in the paper).

    The draws are made on the CPU with Python's ``random`` (string seeds: the same on every machine and
    run) and kept in a table [heads, query blocks, key blocks] that grows as larger positions or heads are
    asked for.
    """

    def __init__(self, block: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int = 0,
                 layer: int = 0, causal: bool = True, length: int | None = None, heads_per_draw: int = 1) -> None:
        self.block = check_count("block", block, 1)
        self.window_blocks = check_count("window_blocks", window_blocks, 1)
        self.global_blocks = check_count("global_blocks", global_blocks, 0)
        self.random_blocks = check_count("random_blocks", random_blocks, 0)
        self.seed, self.layer, self.causal = check_count("seed", seed, 0), check_count("layer", layer, 0), causal
        self.length = None if length is None else check_count("length", length, 1)
        self.heads_per_draw = check_count("heads_per_draw", heads_per_draw, 1)
        self._table = torch.zeros(0, 0, 0, dtype=torch.bool)
        self._n_blocks = None  # encoder: the number of key blocks the table was drawn for
        self._tables = DeviceTables()  # the table and its 2-D prefix sums (for tiles), per device

    def row(self, head: int, i: int, n_blocks: int | None = None) -> list[int]:
        """The random key blocks of query block ``i`` of ``head`` (``n_blocks``: the encoder's block count)."""
        import random

        g, w, r = self.global_blocks, self.window_blocks, self.random_blocks
        if r == 0 or i < g:
            return []
        if self.causal:
            pool = list(range(g, i - w + 1))
            key = f"bigbird:{self.seed}:{self.layer}:{head}:{i}"
        else:
            pool = [j for j in range(g, n_blocks) if abs(i - j) >= w]
            key = f"bigbird:{self.seed}:{self.layer}:{head}:{i}:{n_blocks}"
        return sorted(random.Random(key).sample(pool, min(r, len(pool))))

    def table(self, heads: int, n_blocks: int) -> torch.Tensor:
        """bool [heads, n_blocks, n_blocks]: [h, i, j] = key block j is a random block of query block i."""
        if self.causal:
            have_h, have_n = self._table.shape[:2]
            if heads <= have_h and n_blocks <= have_n:
                return self._table[:heads, :n_blocks, :n_blocks]
            heads, n_blocks = max(heads, have_h), max(n_blocks, have_n)
        elif self._n_blocks == n_blocks and heads <= self._table.shape[0]:
            return self._table[:heads]
        t = torch.zeros(heads, n_blocks, n_blocks, dtype=torch.bool)
        for hh in range(heads):
            if hh % self.heads_per_draw:  # shares the draw of the group's first head
                t[hh] = t[hh - hh % self.heads_per_draw]
                continue
            for i in range(n_blocks):
                t[hh, i, self.row(hh // self.heads_per_draw, i, n_blocks)] = True
        self._table, self._n_blocks = t, n_blocks
        c = torch.zeros(heads, n_blocks + 1, n_blocks + 1, dtype=torch.long)
        c[:, 1:, 1:] = t.long().cumsum(1).cumsum(2)
        self._tables.replace(table=t, counts=c)
        return t

    def prepare(self, heads: int, length: int, device=None) -> None:
        """Draw the table for ``heads`` heads and ``length`` positions now, on ``device`` too: a traced
        evaluation (``vmap`` / ``torch.compile`` in FlexAttention) reads no positions, so it uses the table
        as it stands. Eager evaluations still grow it as they need."""
        self.table(heads, -(-(self.length or length) // self.block))
        self._tables.prepare(device=device)

    def _blocks_for(self, h, q_hi, k_hi) -> tuple[int, int]:
        if is_tracing(q_hi):  # no position can be read: the table as ``prepare`` drew it
            if not self._table.numel():
                raise RuntimeError("BigBird's random blocks must be drawn before the mask is traced (vmap, "
                                   "torch.compile): call its prepare(heads, length, device) first")
            return self._table.shape[0], self._table.shape[1]
        heads = int(torch.as_tensor(h).max()) + 1
        if self.causal:
            return heads, int(q_hi.max()) // self.block + 1
        length = self.length if self.length is not None else int(k_hi.max()) + 1
        return heads, -(-length // self.block)

    def __call__(self, b, h, q_idx, kv_idx):
        heads, nb = self._blocks_for(h, q_idx, kv_idx)
        self.table(heads, nb)
        t = self._tables.get("table", q_idx)[:heads, :nb, :nb]
        qb, kb = q_idx // self.block, kv_idx // self.block
        inside = (qb >= 0) & (qb < nb) & (kb >= 0) & (kb < t.shape[-1])
        hit = t[torch.as_tensor(h, device=q_idx.device), qb.clamp(0, nb - 1), kb.clamp(0, t.shape[-1] - 1)]
        out = hit & inside
        return out & (kv_idx <= q_idx) if self.causal else out

    def tiles(self, b, h, ql, qh, kl, kh):
        heads, nb = self._blocks_for(h, qh, kh)
        self.table(heads, nb)
        c = self._tables.get("counts", ql)
        n = c.shape[-1] - 1
        hh = torch.as_tensor(h, device=ql.device)
        i0, i1 = (ql // self.block).clamp(0, n), (qh // self.block + 1).clamp(0, n)
        j0, j1 = (kl // self.block).clamp(0, n), (kh // self.block + 1).clamp(0, n)
        got = c[hh, i1, j1] - c[hh, i0, j1] - c[hh, i1, j0] + c[hh, i0, j0]
        out = got > 0
        return out & (kl <= qh) if self.causal else out


def bigbird_random(block: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int = 0,
                   layer: int = 0, causal: bool = True, length: int | None = None,
                   heads_per_draw: int = 1) -> Mask:
    """The random component of ``bigbird`` alone (a ``BigBirdRandom`` as a ``Mask``; it varies by head: a
    draw per head, or per ``heads_per_draw`` heads)."""
    rand = BigBirdRandom(block, window_blocks, global_blocks, random_blocks, seed, layer, causal, length,
                         heads_per_draw)
    return Mask(rand, rand.tiles, per_head=random_blocks > 0, prepare=rand.prepare,
                name=f"bigbird_random_{block}x{random_blocks}" + ("" if causal else "_bidir"))


def bigbird(block: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int = 0,
            layer: int = 0, causal: bool = True, length: int | None = None, heads_per_draw: int = 1) -> Mask:
    """BigBird's block-sparse pattern ("Big Bird: Transformers for Longer Sequences", arXiv:2007.14062), in
    blocks of ``block`` positions: ``bigbird_window`` OR ``bigbird_global`` OR ``bigbird_random``."""
    rand = bigbird_random(block, window_blocks, global_blocks, random_blocks, seed, layer, causal, length,
                          heads_per_draw)
    mask = or_masks(bigbird_window(block, window_blocks, causal), bigbird_global(block, global_blocks, causal), rand)
    return mask.named(f"bigbird_{block}" + ("" if causal else "_bidir"))
