import pytest
import torch

from allhere.data.corpus import (
    DataError,
    eval_windows,
    sample_batch,
    stdlib_corpus,
    text_corpus,
)
from allhere.data.recall_task import RecallTask


def test_stdlib_corpus_is_deterministic_and_split_by_file():
    a, b = stdlib_corpus(), stdlib_corpus()
    assert torch.equal(a.train[:10_000], b.train[:10_000]) and torch.equal(a.val, b.val)
    assert len(a.val) > 100_000 and len(a.train) > 20 * len(a.val)
    assert "standard library" in a.describe()


def test_stdlib_corpus_takes_empty_files(tmp_path, monkeypatch):
    """Python 3.12's standard library has empty files, one of them in the validation share: no empty
    document to score, and the bytes of the others as they are."""
    import hashlib
    import sysconfig

    def bucket(name):
        return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100

    names = [f"m{i}.py" for i in range(400)]
    empty_val = next(n for n in names if bucket(n) < 5)
    for n in names:
        (tmp_path / n).write_text("" if n == empty_val else f"x = {n!r}\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    corpus = stdlib_corpus()
    val_names = [n for n in sorted(names) if bucket(n) < 5]
    assert len(corpus.val_docs) == len(val_names) - 1 and all(len(d) for d in corpus.val_docs)
    assert bytes(corpus.val_docs[0].tolist()) == (tmp_path / next(n for n in val_names if n != empty_val)).read_bytes()


def test_text_folder_and_file(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i}\n" * 20)
    c = text_corpus(tmp_path)
    assert len(c.train) > len(c.val) > 0
    single = tmp_path / "doc0.txt"
    c = text_corpus(single)
    assert bytes(c.train.tolist()) + bytes(c.val.tolist()) == single.read_bytes()


@pytest.mark.parametrize("case", ["missing", "empty-file", "empty-folder"])
def test_bad_data_paths_raise_named_errors(tmp_path, case):
    path = {"missing": tmp_path / "nope.txt", "empty-file": tmp_path / "empty.txt",
            "empty-folder": tmp_path / "d"}[case]
    if case == "empty-file":
        path.write_text("  \n")
    if case == "empty-folder":
        path.mkdir()
    with pytest.raises(DataError, match=str(path)):
        text_corpus(path)


def test_saved_dataset_with_text_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"line {i} " * 30 for i in range(50)]})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert len(text_corpus(tmp_path / "ds").train) > 0
    datasets.Dataset.from_dict({"body": ["x"] * 5}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match="no 'text' column"):
        text_corpus(tmp_path / "bad")


def test_batches_are_pure_functions_of_the_generator():
    stream = torch.arange(1000, dtype=torch.int64) % 256
    a = sample_batch(stream.to(torch.uint8), 4, 32, torch.Generator().manual_seed(3))
    b = sample_batch(stream.to(torch.uint8), 4, 32, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (4, 32) and a.dtype == torch.int64
    assert eval_windows(stream, 100, 5).shape == (5, 100)
    with pytest.raises(DataError):
        eval_windows(stream[:50], 100, 5)


def test_recall_task_layout():
    task = RecallTask(seq_len=64, n_pairs=4, n_queries=3)
    ids, retrieval = task.batch(8, torch.Generator().manual_seed(0))
    assert ids.shape == retrieval.shape == (8, 64)
    assert int(ids.max()) < task.vocab_size
    assert retrieval.sum(1).tolist() == [3] * 8
    p0 = task.vocab_size - task.n_keys * task.n_values  # first fact id
    for row, r in zip(ids.tolist(), retrieval):
        facts = {2 + (f - p0) // task.n_values: 2 + task.n_keys + (f - p0) % task.n_values for f in row[1:5]}
        assert len(facts) == 4
        for pos in r.nonzero().flatten().tolist():
            assert facts[row[pos]] == row[pos + 1]  # the answer is the stated value
            assert pos - 4 >= task.min_distance  # the last fact sits at position 4
    with pytest.raises(ValueError, match="too short"):
        RecallTask(seq_len=20, n_pairs=8, n_queries=8)


def test_recall_training_batch_counts_only_answers():
    task = RecallTask(seq_len=64, n_pairs=4, n_queries=3)
    ids, mask = task.training_batch(4, torch.Generator().manual_seed(1))
    _, retrieval = task.batch(4, torch.Generator().manual_seed(1))
    assert torch.equal(mask[:, 1:], retrieval[:, :-1]) and not mask[:, 0].any()
    lengths = {task.training_batch(2, torch.Generator().manual_seed(s), curriculum=True)[0].shape[1] for s in range(20)}
    assert len(lengths) > 1 and max(lengths) <= 64
