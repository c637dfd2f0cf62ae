"""The mixed recall task: a fixed table queried but never stated, fresh pairs stated and asked far later,
filler without marker bytes; accuracy per kind of query checked on oracles."""

from types import SimpleNamespace

import pytest
import torch

from allhere.data.corpus import VOCAB_SIZE
from allhere.data.mixed_recall import (
    ANSWER_LEN,
    ASK_MARK,
    CONTEXT,
    KEY_BASE,
    N_KEYS,
    STATE_MARK,
    TABLE,
    TABLE_MARK,
    MixedTask,
    accuracy,
    score,
)
from allhere.validation import ConfigError

STREAM = torch.tensor(list(b"def f(x):\n    return x + 1  # a comment?\n" * 40), dtype=torch.uint8)
STREAM[::50] = STATE_MARK  # marker and key bytes in the text must not survive as such
STREAM[7::50] = KEY_BASE + 3


def batch(task, seed=0, n=6):
    return task.batch(n, torch.Generator().manual_seed(seed), STREAM)


def items(row: list[int]):
    """(mark, start) of every item in one sequence."""
    return [(b, i) for i, b in enumerate(row) if b in (TABLE_MARK, STATE_MARK, ASK_MARK)]


def test_table_is_fixed_and_never_stated():
    task = MixedTask()
    ent, att = task.table()
    assert ent.shape == (512, 3) and att.shape == (512, 2)
    assert len({bytes(e.tolist()) for e in ent}) == 512  # distinct entities
    assert torch.equal(MixedTask(seq_len=256).table()[1], att)  # the same table whatever the sequence
    assert not torch.equal(MixedTask(table_seed=1).table()[1], att)
    table = {bytes(e.tolist()): bytes(a.tolist()) for e, a in zip(ent, att)}
    for seed in (0, 1):
        ids, kind = batch(task, seed)
        for row, krow in zip(ids.tolist(), kind.tolist()):
            for mark, i in items(row):
                if mark == TABLE_MARK:
                    assert table[bytes(row[i + 1:i + 4])] == bytes(row[i + 5:i + 7])
                    assert krow[i + 5] == TABLE and row[i + 4] == ord("=")


def test_pairs_are_fresh_stated_first_and_asked_after_the_gap():
    task = MixedTask(seq_len=128, pairs=2, table_queries=3, min_gap=32)
    ids, kind = batch(task)
    assert ids.shape == kind.shape == (6, 128) and ids.max() < VOCAB_SIZE
    assert not torch.equal(ids, batch(task, seed=1)[0]) and torch.equal(ids, batch(task)[0])  # a function of g
    statements = []
    for row, krow in zip(ids.tolist(), kind.tolist()):
        found = items(row)
        assert [m for m, _ in found].count(TABLE_MARK) == 3  # no marker byte left in the filler
        stated = {row[i + 1]: (bytes(row[i + 2:i + 4]), i) for m, i in found if m == STATE_MARK}
        asked = [(row[i + 1], bytes(row[i + 2:i + 4]), i) for m, i in found if m == ASK_MARK]
        assert len(stated) == len(asked) == 2 and [i for _, i in stated.values()] == [0, 5]
        assert sum(KEY_BASE <= b < KEY_BASE + N_KEYS for b in row) == 4  # keys: reserved bytes, never filler
        for key, value, i in asked:
            assert stated[key][0] == value and value.isdigit() and krow[i + 2] == CONTEXT
            assert i - 10 >= task.min_gap  # more than 4 chunks of 8 after the last statement
        assert sum(k > 0 for k in krow) == 5
        statements.append(sorted(stated.items()))
    assert len({str(s) for s in statements}) == len(statements)  # fresh pairs in every sequence


def test_bad_shapes_are_refused():
    with pytest.raises(ConfigError, match="too short"):
        MixedTask(seq_len=40, pairs=2, table_queries=2, min_gap=16)
    with pytest.raises(ConfigError, match="n_facts"):
        MixedTask(n_facts=0)


class Oracle:
    """Predicts every byte right where it can: table answers from the table; pair answers by reading the
    statements earlier in the sequence when ``reads_context``; byte 255 everywhere else."""

    def __init__(self, task, reads_context):
        ent, att = task.table()
        self.table = {tuple(e.tolist()): a.tolist() for e, a in zip(ent, att)}
        self.reads_context = reads_context

    def __call__(self, ids):
        logits = torch.zeros(*ids.shape, VOCAB_SIZE)
        logits[..., 255] = 1
        for b, row in enumerate(ids.tolist()):
            for p in range(len(row)):
                for mark, i in items(row[:p + 1]):
                    if mark == TABLE_MARK and p in (i + 4, i + 5):
                        logits[b, p, self.table[tuple(row[i + 1:i + 4])][p - i - 4]] = 2
                    if mark == ASK_MARK and p in (i + 1, i + 2) and self.reads_context:
                        s = next(j for m, j in items(row) if m == STATE_MARK and row[j + 1] == row[i + 1])
                        logits[b, p, row[s + 2 + p - i - 1]] = 2
        return SimpleNamespace(logits=logits)


def test_accuracy_per_kind_on_oracles():
    task = MixedTask(seq_len=96, pairs=2, table_queries=2, min_gap=16)
    ids, kind = batch(task, n=4)
    assert accuracy(Oracle(task, True), ids, kind, batch=3) == {"table": 1.0, "context": 1.0}
    assert accuracy(Oracle(task, False), ids, kind) == {"table": 1.0, "context": 0.0}
    logits = Oracle(task, True)(ids).logits
    first = kind.nonzero()[0]  # one wrong byte makes its whole query wrong
    logits[first[0], first[1] + ANSWER_LEN - 2, :] = 0
    counts = score(logits, ids, kind)
    assert sum(c for c, _ in counts.values()) == 4 * 4 - 1 and all(n == 8 for _, n in counts.values())
