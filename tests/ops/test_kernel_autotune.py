"""Launch settings chosen on the device (``allhere.kernels.autotune``), checked without a GPU: the device's
identity, its candidates and the timer are stand-ins; the choice logic, the file that keeps choices across
processes, pinning and the pruning rules are the real ones."""

import json

import pytest
import torch

from allhere.kernels import autotune, tiles

pytestmark = pytest.mark.unpinned  # the tests set their own pins
CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU whose candidates are three decode settings, timed by a table (the second is fastest)."""
    candidates = [dict(SPLIT=512, BLOCK_N=64, num_warps=4, num_stages=2),
                  dict(SPLIT=256, BLOCK_N=64, num_warps=4, num_stages=2),
                  dict(SPLIT=1024, BLOCK_N=128, num_warps=8, num_stages=3)]
    ms = {512: 0.30, 256: 0.10, 1024: 0.20}
    timed = []

    def bench(fn):
        fn()
        timed.append(launched[-1]["SPLIT"])
        return ms[launched[-1]["SPLIT"]]

    launched = []
    monkeypatch.setattr(autotune, "_identity", lambda kernel, key, device: f"Fake GPU sm90|triton x|{kernel}|{key}")
    monkeypatch.setattr(autotune, "_candidates", lambda *a: [dict(c) for c in candidates])
    monkeypatch.setattr(autotune, "_bench", bench)
    autotune.set_store_path(tmp_path / "settings.json")
    autotune.forget()
    yield dict(launch=launched.append, timed=timed, ms=ms, path=tmp_path / "settings.json")
    autotune.set_store_path(None)
    autotune.forget()


def choose(gpu, key=("d128", "n32768"), launch=None):
    return autotune.setting("decode", key, CUDA, launch or gpu["launch"], 128, 2, length=32768)


def test_the_fastest_candidate_is_chosen_once_and_kept_across_processes(fake_gpu):
    assert choose(fake_gpu)["SPLIT"] == 256
    assert fake_gpu["timed"] == [512, 256, 1024]
    assert choose(fake_gpu)["SPLIT"] == 256 and len(fake_gpu["timed"]) == 3  # this process: no second tuning
    (record,) = autotune.choices()
    assert record["source"] == "tuned" and record["tried"] == 3 and record["ms"] == 0.1 and record["tuning_s"] >= 0
    stored = json.loads(fake_gpu["path"].read_text())["entries"]
    assert list(stored.values())[0]["setting"]["SPLIT"] == 256
    autotune.forget()  # as a new process: read from the file, nothing timed
    assert choose(fake_gpu)["SPLIT"] == 256 and len(fake_gpu["timed"]) == 3
    assert autotune.choices()[0]["source"] == "file"


def test_nothing_is_timed_while_a_cuda_graph_is_captured(fake_gpu, monkeypatch):
    monkeypatch.setattr(autotune, "capturing", lambda: True)
    assert choose(fake_gpu)["SPLIT"] == 512 and fake_gpu["timed"] == [] and autotune.choices() == []
    monkeypatch.setattr(autotune, "capturing", lambda: False)
    assert choose(fake_gpu)["SPLIT"] == 256 and fake_gpu["timed"] == [512, 256, 1024]  # eager: tuned then


def test_another_shape_class_is_tuned_apart_and_the_file_keeps_both(fake_gpu):
    choose(fake_gpu)
    fake_gpu["ms"][1024] = 0.01
    assert choose(fake_gpu, key=("d128", "n131072"))["SPLIT"] == 1024
    assert len(json.loads(fake_gpu["path"].read_text())["entries"]) == 2


def test_a_candidate_that_fails_is_skipped_and_none_working_is_one_error(fake_gpu):
    def launch(setting):
        if setting["SPLIT"] == 256:
            raise RuntimeError("out of resources: shared memory")
        fake_gpu["launch"](setting)

    assert choose(fake_gpu, launch=launch)["SPLIT"] == 1024
    assert autotune.choices()[0]["failed"] == 1

    def broken(setting):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no launch setting of the decode kernel runs on this GPU"):
        choose(fake_gpu, key=("other",), launch=broken)


def test_an_unreadable_file_is_retuned_and_rewritten(fake_gpu):
    fake_gpu["path"].write_text("{not json")
    assert choose(fake_gpu)["SPLIT"] == 256 and fake_gpu["timed"]
    assert json.loads(fake_gpu["path"].read_text())["version"] == 1


def test_pinned_settings_are_never_timed(fake_gpu):
    with autotune.pinned():
        assert choose(fake_gpu)["SPLIT"] == 512  # the first candidate this GPU runs
        with autotune.pinned({"decode": {"BLOCK_N": 32}}):
            assert choose(fake_gpu) == dict(SPLIT=512, BLOCK_N=32, num_warps=4, num_stages=2)
            assert autotune.pins() == {"decode": {"BLOCK_N": 32}}
    assert autotune.pins() is None and fake_gpu["timed"] == [] and not fake_gpu["path"].exists()
    with pytest.raises(ValueError, match="unknown kernel"):
        with autotune.pinned({"prefill": {}}):
            pass


def test_the_interpreter_uses_the_default_setting(fake_gpu):
    got = autotune.setting("global", ("d16",), torch.device("cpu"), fake_gpu["launch"], 16, 4)
    assert got == tiles.default("global") and fake_gpu["timed"] == []
    with autotune.pinned({"global": {"BLOCK_M": 16}}):
        assert autotune.setting("global", ("d16",), torch.device("cpu"), fake_gpu["launch"], 16, 4)["BLOCK_M"] == 16


def test_length_buckets():
    assert [autotune.length_bucket(n) for n in (1, 256, 257, 4096, 5000, 131072)] == [256, 256, 512, 4096, 8192, 131072]


def test_pruning_follows_the_device():
    h100 = dict(capability=(9, 0), max_shared=232448)
    forward = tiles.prune("global", 128, 2, **h100)
    assert forward and all(not (s["num_warps"] == 8 and s["BLOCK_M"] * s["BLOCK_N"] < 128 * 128) for s in forward)
    assert all(tiles.shared_bytes(s, 128, 2) <= h100["max_shared"] for s in forward)
    assert tiles.default("global") in tiles.prune("global", 128, 2, (8, 0), 166912)  # an A100 keeps it
    small = tiles.prune("global", 128, 2, (8, 9), 101376)  # 99 KiB per block (sm_89)
    assert small and all(tiles.shared_bytes(s, 128, 2) <= 101376 for s in small)
    assert len(small) < len(tiles.FORWARD)
    assert all(s["BLOCK_M"] <= 64 for s in tiles.prune("sliding", 64, 2, (9, 0), 232448, length=64))
    short, long = (tiles.prune("global", 128, 2, **h100, length=n) for n in (4096, 32768))
    assert {s["BLOCK_M"] for s in short} > {s["BLOCK_M"] for s in long} == {64, 128}  # 32-row tiles: short only
    assert all(s["SPLIT"] <= 512 for s in tiles.prune("decode", 128, 2, (9, 0), 232448, length=300))
    assert tiles.prune("global", 128, 2, (9, 0), 1024) == [tiles.default("global")]  # never empty
    # a handful each on an H100 (a bounded first call); tensor descriptors only from Hopper on
    assert all(2 <= len(tiles.prune(k, 128, 2, **h100, length=32768)) <= 8 for k in tiles.SPACES)
    assert not any(s.get("TMA") for s in tiles.prune("global", 128, 2, (8, 0), 166912))
