"""A folder written whole or not at all (``allhere.runtime.atomic_folder``): published by one rename (or swap), an
error leaves nothing, what a killed write left is removed or put back by the next one, a folder holding files is
kept unless it is to be replaced. Killed commands (convert, sft) are in tests/cli/test_whole_writes.py."""

import os

import pytest

from allhere.runtime import atomic_folder
from allhere.runtime.atomic_folder import partial_path, write_folder
from allhere.runtime.runlock import LOCK_NAME, run_lock
from allhere.validation import ConfigError


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_published_whole_and_nothing_on_error(tmp_path):
    target = tmp_path / "model"
    with write_folder(target) as tmp:
        assert tmp == partial_path(target) and tmp.parent == tmp_path and names(tmp) == []
        (tmp / "config.json").write_text("{}")
        assert not target.exists()  # nothing at the final name while it is written
    assert names(target) == ["config.json"] and names(tmp_path) == ["model"]
    with pytest.raises(KeyboardInterrupt):
        with write_folder(tmp_path / "other") as tmp:
            (tmp / "config.json").write_text("{}")
            raise KeyboardInterrupt
    assert names(tmp_path) == ["model"]  # neither the folder nor its partial one


def test_a_killed_writes_partial_folder_is_removed_by_the_next(tmp_path):
    target = tmp_path / "model"
    partial_path(target).mkdir()
    (partial_path(target) / "config.json").write_text("half")  # as a kill -9 left it
    with write_folder(target) as tmp:
        assert names(tmp) == []
        (tmp / "model.safetensors").write_text("whole")
    assert names(target) == ["model.safetensors"] and names(tmp_path) == ["model"]


def test_a_folder_holding_files_is_kept_unless_replaced(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("good")
    with pytest.raises(ConfigError, match="already holds files"):
        with write_folder(target) as tmp:
            (tmp / "config.json").write_text("new")
    assert (target / "config.json").read_text() == "good" and names(tmp_path) == ["model"]
    with write_folder(target, replace=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert names(target) == ["config.json"] and (target / "config.json").read_text() == "new"
    assert names(tmp_path) == ["model"]


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "two-renames"])
def test_the_run_lock_folder_is_replaced_while_held(tmp_path, monkeypatch, swap):
    """convert's --out: the folder its run lock made, replaced by the model while the lock is held."""
    swaps = []
    real = atomic_folder._exchange
    # without swap: a system without renameat2
    monkeypatch.setattr(atomic_folder, "_exchange", lambda a, b: swaps.append(swap and real(a, b)) or swaps[-1])
    out = tmp_path / "out"
    with run_lock(out):
        assert names(out) == [LOCK_NAME]
        with write_folder(out) as tmp:
            (tmp / "config.json").write_text("{}")
        assert names(out) == ["config.json"]
    assert names(out) == ["config.json"] and names(tmp_path) == ["out"]
    assert swaps == [swap] or (swap and swaps == [False] and not os.uname().sysname == "Linux")


def test_an_old_folder_a_killed_swap_set_aside_comes_back(tmp_path):
    target = tmp_path / "model"
    old = tmp_path / ".model.old"  # killed between its two renames: the model aside, none in place
    old.mkdir()
    (old / "config.json").write_text("good")
    assert atomic_folder.clean_stale(target) == [] and (target / "config.json").read_text() == "good"
    old.mkdir()
    (old / "config.json").write_text("older")  # killed after the second rename: the new one in place
    assert atomic_folder.clean_stale(target) == [old] and (target / "config.json").read_text() == "good"
    assert names(tmp_path) == ["model"]


def test_files_and_folders_are_synced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    with write_folder(tmp_path / "model") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.json").write_text("{}")
    part = str(partial_path(tmp_path / "model"))
    assert synced == [f"{part}/sub/a.json", f"{part}/sub", part, str(tmp_path)]


def test_a_link_is_written_where_it_points(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "model").mkdir()
    (tmp_path / "model").symlink_to(tmp_path / "disk" / "model")  # e.g. --out on another filesystem
    with write_folder(tmp_path / "model") as tmp:
        assert tmp.parent == tmp_path / "disk"  # beside the folder it points to: one filesystem, one rename
        (tmp / "config.json").write_text("{}")
    assert (tmp_path / "model").is_symlink() and names(tmp_path / "disk") == ["model"]
    assert names(tmp_path / "model") == ["config.json"]
