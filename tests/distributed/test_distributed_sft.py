"""``allhere sft`` on a 2 x 2 mesh (2 data-parallel replicas x 2 context-parallel ranks, 4 gloo processes): a
Hugging Face model with tied embeddings, loaded straight into FSDP2 shards, fine-tuned with AHA on packed
chat data, gives the one-process run's loss at every step and its final weights."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from allhere import ConfigError  # noqa: E402
from allhere.hf import load_pretrained  # noqa: E402
from allhere.runtime.model_checkpoint import read_checkpoint  # noqa: E402

import dist_worker  # noqa: E402
from hf_fixtures import write_chat, write_model  # noqa: E402

SETTINGS = dict(window=4, seq_len=32, batch_size=2, global_batch=8, max_steps=3, lr=3e-4, lam=0.01)


def run_sft(rank, world, tmp, model, data, out, context_parallel):
    from allhere.hf import sft

    state = sft(model, data, out, progress=False, context_parallel=context_parallel, **SETTINGS)
    return {"history": state["history"], "load": state.get("load")}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft2x2")
    model = write_model("Llama-3.2-1B", tmp / "llama", init_std=0.1)  # tied embeddings, llama3 rope scaling
    return tmp, str(model), str(write_chat(tmp / "chat.jsonl", n=40))


@pytest.mark.slow
def test_two_by_two_mesh_matches_one_process(inputs):
    tmp, model, data = inputs
    mesh = dist_worker.launch(run_sft, 4, tmp / "results", model, data, str(tmp / "mesh"), 2)
    one = run_sft(0, 1, tmp, model, data, str(tmp / "one"), 1)
    steps = [h["step"] for h in one["history"]]
    assert steps == list(range(1, SETTINGS["max_steps"] + 1))
    for res in mesh:
        assert [h["step"] for h in res["history"]] == steps
        for a, b in zip(res["history"], one["history"]):
            for f in ("loss", "lm", "mu_f"):
                assert abs(a[f] - b[f]) <= 1e-4, (f, a, b)
    ours, _ = read_checkpoint(tmp / "mesh" / "checkpoint.safetensors")
    theirs, _ = read_checkpoint(tmp / "one" / "checkpoint.safetensors")
    weights = [k for k in theirs if k.startswith("model.")]
    assert any(".allhere." in k for k in weights) and set(weights) <= set(ours)
    for k in weights:
        assert (ours[k] - theirs[k]).abs().max() <= 1e-5, k
    published = load_file(str(Path(model) / "model.safetensors"))  # and the weights moved far more than that
    moved = [(ours[f"model.hf.{k}"] - v.float()).abs().max().item() for k, v in published.items()]
    assert min(moved) > 1e-4, moved
    saved = {}  # rank 0's out/model: the gathered weights in the published dtype, loadable as one process's
    for run in ("mesh", "one"):
        folder = tmp / run / "model"
        saved[run] = load_file(str(folder / "model.safetensors"))
        model = load_pretrained(folder)
        with torch.no_grad():
            saved[run]["logits"] = model(torch.arange(5, 37)[None]).logits
    assert saved["mesh"].keys() == saved["one"].keys()
    for k, v in saved["one"].items():
        assert torch.allclose(saved["mesh"][k].float(), v.float(), rtol=1e-2, atol=1e-3), k
    load = mesh[0]["load"]
    assert len(load["peak_rss_delta_bytes"]) == 4 and one["load"] is None


def test_context_parallel_needs_the_processes(inputs, tmp_path):
    _, model, data = inputs
    with pytest.raises(ConfigError, match="needs a multiple of 2 processes"):
        run_sft(0, 1, tmp_path, model, data, str(tmp_path / "x"), 2)

