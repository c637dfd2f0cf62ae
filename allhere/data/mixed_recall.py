"""A byte-level task that needs both memory in parameters and reading of the context.

Every sequence (bytes, vocabulary ``allhere.data.corpus.VOCAB_SIZE``) mixes three things:

  (a) table queries ``\\x01eee=AA\\n`` (8 bytes): entity ``eee`` (3 lowercase letters) and its attribute
      ``AA`` (2 uppercase letters) from ONE fixed table of ``n_facts`` pairs, the same for every sequence
      (generated from ``table_seed``) and never stated in any sequence: only parameters can learn it;
  (b) key/value pairs drawn fresh for every sequence, stated at the start as ``\\x02Kdd\\n`` (5 bytes: key
      ``K`` one byte of 0x10-0x1f, which text never holds, value ``dd`` 2 digits) and each asked once later
      as ``\\x03Kdd\\n``, at least ``min_gap`` bytes after the last statement: only reading the context can
      answer them. A key is one reserved byte so that one attention hop (to the byte after the earlier
      K: an induction head) finds its value and no filler byte looks like a key;
  (c) filler: consecutive bytes of a text stream (the stdlib corpus), bytes 1-3 and 0x10-0x1f replaced by
      spaces.

Layout: statements, filler (at least ``min_gap`` bytes), then the queries of (a) and (b) in random order
with random filler between and after them. The answer of a query is its last 2 bytes before the newline; a model is
scored on them teacher-forced (argmax of the logits at the position before each answer byte), and a
query counts as correct when both bytes are. Chance: 1/676 for (a), 1/100 for (b).
Everything is a pure function of the torch generator passed in (and the fixed table seed).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..validation import ConfigError

TABLE_MARK, STATE_MARK, ASK_MARK = 1, 2, 3  # the first byte of each item
TABLE, CONTEXT = 1, 2  # kinds of query (the value of ``kind`` at an answer's first byte)
KINDS = {TABLE: "table", CONTEXT: "context"}
ANSWER_LEN = 2
TABLE_ITEM, PAIR_ITEM = 8, 5  # bytes of a table query; of a statement or a context query
KEY_BASE, N_KEYS = 0x10, 16  # the key bytes of (b)
_LOWER, _UPPER, _DIGIT = ord("a"), ord("A"), ord("0")


@dataclass(frozen=True)
class MixedTask:
    seq_len: int = 128  # bytes per sequence
    n_facts: int = 512  # size of the fixed table (a)
    table_queries: int = 2  # table queries per sequence (facts drawn with replacement)
    pairs: int = 4  # key/value pairs stated and asked per sequence (b)
    min_gap: int = 32  # fewest bytes between the end of the statements and the first query
    table_seed: int = 20261125  # the table is a function of this seed alone

    def __post_init__(self) -> None:
        if not 1 <= self.n_facts <= 26 ** 3:
            raise ConfigError(f"MixedTask.n_facts = {self.n_facts} is invalid: expected 1 to {26 ** 3}")
        if self.table_queries < 0 or not 0 <= self.pairs <= N_KEYS or self.min_gap < 0:
            raise ConfigError(f"MixedTask needs table_queries >= 0, 0 <= pairs <= {N_KEYS} and min_gap >= 0, "
                              f"got {self}")
        if self.filler_len < self.min_gap:
            raise ConfigError(f"MixedTask.seq_len = {self.seq_len} is too short for {self.pairs} pairs, "
                              f"{self.table_queries} table queries and a gap of {self.min_gap} bytes")

    @property
    def filler_len(self) -> int:
        return self.seq_len - 2 * PAIR_ITEM * self.pairs - TABLE_ITEM * self.table_queries

    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed facts: entities [n_facts, 3] and attributes [n_facts, 2], uint8 bytes."""
        return _table(self.n_facts, self.table_seed)

    def batch(self, batch: int, generator: torch.Generator, stream: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [batch, seq_len] int64 and kind [batch, seq_len] int8: TABLE or CONTEXT at the first byte of
        every answer, 0 elsewhere. ``stream``: uint8 text the filler is cut from."""
        if len(stream) < self.filler_len:
            raise ConfigError(f"the filler stream of {len(stream)} bytes is shorter than {self.filler_len}")
        ids = torch.empty(batch, self.seq_len, dtype=torch.int64)
        kind = torch.zeros(batch, self.seq_len, dtype=torch.int8)
        for b in range(batch):
            ids[b], kind[b] = self._sequence(generator, stream)
        return ids, kind

    def _sequence(self, g: torch.Generator, stream: torch.Tensor):
        entities, attributes = self.table()
        keys = torch.randperm(N_KEYS, generator=g)[: self.pairs]
        values = torch.randint(0, 100, (self.pairs,), generator=g)
        facts = torch.randint(0, self.n_facts, (self.table_queries,), generator=g)
        start = int(torch.randint(0, len(stream) - self.filler_len + 1, (1,), generator=g))
        filler = stream[start:start + self.filler_len].long().clone()
        marks = (filler >= TABLE_MARK) & (filler <= ASK_MARK)
        reserved = marks | ((filler >= KEY_BASE) & (filler < KEY_BASE + N_KEYS))
        filler[reserved] = ord(" ")
        n_items = self.pairs + self.table_queries
        order = torch.randperm(n_items, generator=g).tolist()
        spare = self.filler_len - self.min_gap  # shared at random between the gap and after each query
        cuts = torch.randint(0, spare + 1, (n_items,), generator=g).sort().values.tolist()
        pieces = [b - a for a, b in zip([0] + cuts, cuts + [spare])]
        pieces[0] += self.min_gap

        out, kinds, used = [], [], 0

        def put(item: list[int], answer_kind: int = 0) -> None:
            if answer_kind:
                kinds.append((len(out) + len(item) - ANSWER_LEN - 1, answer_kind))
            out.extend(item)

        def fill(n: int) -> None:
            nonlocal used
            out.extend(filler[used:used + n].tolist())
            used += n

        pair = lambda mark, i: [mark, KEY_BASE + int(keys[i]), _DIGIT + int(values[i]) // 10,  # noqa: E731
                                _DIGIT + int(values[i]) % 10, ord("\n")]
        for i in range(self.pairs):
            put(pair(STATE_MARK, i))
        for piece, item in zip(pieces, order):
            fill(piece)
            if item < self.pairs:
                put(pair(ASK_MARK, item), CONTEXT)
            else:
                f = int(facts[item - self.pairs])
                put([TABLE_MARK, *entities[f].tolist(), ord("="), *attributes[f].tolist(), ord("\n")], TABLE)
        fill(pieces[-1])
        kind = torch.zeros(self.seq_len, dtype=torch.int8)
        for pos, k in kinds:
            kind[pos] = k
        return torch.tensor(out, dtype=torch.int64), kind


@functools.lru_cache(maxsize=8)
def _table(n_facts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    e = torch.randperm(26 ** 3, generator=g)[:n_facts]
    a = torch.randint(0, 26 * 26, (n_facts,), generator=g)
    entities = torch.stack([e // 676, e // 26 % 26, e % 26], 1) + _LOWER
    attributes = torch.stack([a // 26, a % 26], 1) + _UPPER
    return entities.to(torch.uint8), attributes.to(torch.uint8)


def score(logits: torch.Tensor, ids: torch.Tensor, kind: torch.Tensor) -> dict[str, list[int]]:
    """Per kind of query [correct, total]: a query is correct when the argmax of the logits before each of
    its answer bytes is that byte (teacher forcing). logits [B, L, V], ids [B, L], kind [B, L]."""
    hit = logits[:, :-1].argmax(-1) == ids[:, 1:]  # hit[:, p - 1]: byte p predicted
    counts = {}
    for k, name in KINDS.items():
        b, p = (kind == k).nonzero(as_tuple=True)
        ok = torch.ones_like(b, dtype=torch.bool)
        for j in range(ANSWER_LEN):
            ok &= hit[b, p + j - 1]
        counts[name] = [int(ok.sum()), len(b)]
    return counts


@torch.no_grad()
def accuracy(model, ids: torch.Tensor, kind: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Share of correct queries per kind for ``model`` (anything returning ``.logits`` from ids)."""
    total = {name: [0, 0] for name in KINDS.values()}
    for x, k in zip(ids.split(batch), kind.split(batch)):
        for name, (c, n) in score(model(x).logits, x, k).items():
            total[name][0] += c
            total[name][1] += n
    return {name: c / n if n else float("nan") for name, (c, n) in total.items()}
