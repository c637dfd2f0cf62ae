"""The weight files of a saved model folder (``allhere.hf.files``): those its safetensors index names, all inside
the folder; an index that is not one, or that names a file outside the folder, is one line naming the index."""

import json

import pytest

pytest.importorskip("transformers")

from allhere.hf.files import weight_files  # noqa: E402
from allhere.hf.sharded_load import _index  # noqa: E402
from allhere.runtime.model_checkpoint import CheckpointError  # noqa: E402


def with_index(tmp_path, index) -> tuple:
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.safetensors.index.json"
    path.write_text(index if isinstance(index, str) else json.dumps(index))
    return folder, path


def test_files_named_by_the_index(tmp_path):
    folder, _ = with_index(tmp_path, {"metadata": {}, "weight_map": {"a": "model-1.safetensors",
                                                                     "b": "sub/model-2.safetensors",
                                                                     "c": "model-1.safetensors"}})
    assert weight_files(folder) == [folder / "model-1.safetensors", folder / "sub" / "model-2.safetensors"]
    assert _index(folder)["b"] == folder / "sub" / "model-2.safetensors"


@pytest.mark.parametrize("name", ["/etc/passwd", "../other/model.safetensors", "sub/../../model.safetensors", ".."])
def test_a_file_outside_the_folder_is_refused(tmp_path, name):
    folder, index = with_index(tmp_path, {"weight_map": {"a": "model-1.safetensors", "b": name}})
    for read in (weight_files, _index):
        with pytest.raises(CheckpointError) as e:
            read(folder)
        assert str(e.value) == f"{index} names a weight file outside its folder ({name!r}); refused"


@pytest.mark.parametrize("data", [b"{not json", b"[1]", b'{"metadata": {}}', b'{"weight_map": ["a"]}',
                                  b'{"weight_map": {"a": 3}}', b'{"weight_map": {"a": ""}}', b"\xff\xfe not UTF-8"])
def test_an_index_that_is_not_one_is_one_line(tmp_path, data):
    folder, index = with_index(tmp_path, "")
    index.write_bytes(data)
    for read in (weight_files, _index):
        with pytest.raises(CheckpointError, match=f"^{index} is not a safetensors index") as e:
            read(folder)
        assert "\n" not in str(e.value)
