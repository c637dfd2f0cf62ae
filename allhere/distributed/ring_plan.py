"""Which ring rounds run, which key/value chunks travel, which blocks are computed: one plan, used both
by the ring (``ring.py``) and by the cost model of the recipes (``allhere_recipes.cost``), so the model
counts what the ring does.

Round t: rank r computes with the key/value chunks of rank (r - t) mod d (round 0: its own). Each block
is sent by its owner directly to the rank that reads it in that round -- the same rotation as the
classic ring, where the block reaching rank r in round t is rank (r - t)'s, but from the owner rather
than relayed through every rank in between. That is what makes skipping exact: a round no query of rank
r reads costs rank r nothing, and only the chunks some query reads are sent.

A block (query chunk, key chunk) is one of:
  - "all": every query row of the chunk is computed against the key chunk;
  - "wide": only the rows whose selector is set (AHA's global (token, head) pairs), gathered per
    (batch, head) -- used when the narrow pattern (the window) keeps nothing in the block;
  - skipped: no kept score for any row (decided from positions alone, and from the all-gathered count
    of selected rows per query chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .layouts import chunk_len, chunks_per_rank, rank_chunks
from .ring_blocks import Pattern


@dataclass(frozen=True)
class RingSpec:
    """What the ring computes: ``wide`` for every row (no selector), or with a per-(batch, head, row)
    selector ``wide`` where it is set and ``narrow`` where not (AHA: causal / window). ``narrow`` must
    keep a subset of what ``wide`` keeps."""

    wide: Pattern
    narrow: Pattern | None = None


@dataclass(frozen=True)
class Block:
    q_chunk: int  # index of the query chunk in this rank's shard
    k_chunk: int  # index of the key chunk in the source rank's shard
    rows: str  # "all" | "wide"


@dataclass
class RingPlan:
    n: int
    world: int
    layout: str
    chunk: int  # tokens per chunk
    spec: RingSpec | None = None
    wide_rows: list[list[int]] | None = None  # [rank][q chunk]: most selected rows of one (batch, head)
    _memo: dict = field(default_factory=dict, repr=False)

    def src(self, rank: int, t: int) -> int:
        return (rank - t) % self.world

    def dst(self, rank: int, t: int) -> int:
        return (rank + t) % self.world

    def needed(self, rank: int, t: int) -> list[int]:
        """Chunks (indices in the source's shard) rank ``rank`` reads in round t, in shard order."""
        return sorted({b.k_chunk for b in self.blocks(rank, t)})

    def rows(self, rank: int, block: Block) -> int:
        """Query rows computed per (batch, head) for ``block`` on ``rank``."""
        return self.chunk if block.rows == "all" else self.wide_rows[rank][block.q_chunk]

    def transfers(self, rank: int) -> int:
        """Rounds in which ``rank`` receives a key/value block (round 0 is local)."""
        return sum(1 for t in range(1, self.world) if self.blocks(rank, t))

    def blocks(self, rank: int, t: int) -> list[Block]:
        """The blocks rank ``rank`` computes in round t (worked out on first use: a rank needs only its
        own rounds and, to know what to send, the blocks others read from it)."""
        key = (rank, t)
        if key not in self._memo:
            self._memo[key] = self._decide(rank, t)
        return self._memo[key]

    def _decide(self, r: int, t: int) -> list[Block]:
        spec, c = self.spec, self.chunk
        theirs = rank_chunks(self.layout, self.world, self.src(r, t))
        blocks = []
        for i, cq in enumerate(rank_chunks(self.layout, self.world, r)):
            q0, q1 = cq * c, (cq + 1) * c
            for j, ck in enumerate(theirs):
                k0, k1 = ck * c, (ck + 1) * c
                if spec.narrow is None:
                    if self._kept("wide", q0, q1, k0, k1):
                        blocks.append(Block(i, j, "all"))
                elif self._kept("narrow", q0, q1, k0, k1):
                    blocks.append(Block(i, j, "all"))
                elif self.wide_rows[r][i] > 0 and self._kept("wide", q0, q1, k0, k1):
                    blocks.append(Block(i, j, "wide"))
        return blocks

    def _kept(self, which: str, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether the block holds a kept score of ``spec.wide`` / ``spec.narrow``: read off the pattern's map
        of every block (``Pattern.kept_map``, made on first use), or asked of the pattern block by block."""
        pattern = getattr(self.spec, which)
        if which not in self._memo:
            self._memo[which] = pattern.kept_map(self.world * chunks_per_rank(self.layout), self.chunk)
        kept = self._memo[which]
        if kept is None:
            return pattern.block_kept(q0, q1, k0, k1)
        return kept[q0 // self.chunk][k0 // self.chunk]


def make_plan(spec: RingSpec, n: int, world: int, layout: str,
              wide_rows: list[list[int]] | None = None) -> RingPlan:
    """The plan for a sequence of n tokens over ``world`` ranks. ``wide_rows`` [rank][q chunk]: with a
    selector, the largest number of selected rows of one (batch, head) in each query chunk (0: none is
    selected, so the chunk reads only what ``narrow`` keeps); None: every row selected."""
    c = chunk_len(n, layout, world)
    cpr = chunks_per_rank(layout)
    if spec.narrow is not None and wide_rows is None:
        wide_rows = [[c] * cpr for _ in range(world)]
    return RingPlan(n, world, layout, c, spec, wide_rows)
