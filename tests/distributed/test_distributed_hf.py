"""Converted Hugging Face models under context parallelism (2 gloo processes): a packed batch of documents
gives the one-process loss and gradients through the ring, for full, sliding, AHA and DAR attention (DAR's
distant keys rebuilt from latents by the host's own K/V path at their rotary positions, which restart
with every document)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import dist_hf_worker as W  # noqa: E402
import dist_worker  # noqa: E402
from hf_fixtures import write_model  # noqa: E402

CASES = [("full", "zigzag"), ("sliding", "contiguous"), ("aha", "zigzag"), ("dar", "zigzag")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(write_model("Llama-3.2-1B", tmp_path_factory.mktemp("hf") / "llama", init_std=0.1))


@pytest.fixture(scope="module")
def two_ranks(folder, tmp_path_factory):
    return dist_worker.launch(W.sharded, 2, tmp_path_factory.mktemp("results"), folder, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout", CASES)
def test_packed_documents_match_one_process(folder, two_ranks, kind, layout):
    one = W.single(folder, kind)
    for res in two_ranks:
        got = res[f"{kind}-{layout}"]
        assert (abs(got["total"] - one["total"]) <= 1e-5
                and abs(got["lm"] - one["lm"]) <= 1e-5), (got["total"], one["total"])
        assert got["grads"].keys() == one["grads"].keys()
        for name, g in one["grads"].items():
            assert torch.allclose(got["grads"][name], g, atol=1e-5, rtol=1e-4), name


def test_segments_matter(folder):
    """The documents change the loss (so the test above checks the ring's segment masking)."""
    net = W.model(folder, "full")
    ids, starts = W.batch(net.hf.config.vocab_size)
    with torch.no_grad():
        a = net(ids, segment_starts=starts).logits
        b = net(ids).logits
    assert (a - b).abs().max() > 1e-3


def test_unconverted_layers_are_refused(two_ranks):
    assert "attention layers [1] have no mechanism: a hybrid model's" in two_ranks[0]["refused"]


def test_length_dependent_rope_is_refused(tmp_path):
    """Phi-4-mini's longrope picks its frequencies from the sequence length, which a shard does not see."""
    from allhere.distributed.context import check_supported
    from allhere.hf import HFCausalLM, convert
    from allhere.mechanisms import FullConfig
    transformers = pytest.importorskip("transformers")

    folder = write_model("Phi-4-mini", tmp_path / "phi")
    net = HFCausalLM(convert(transformers.AutoModelForCausalLM.from_pretrained(str(folder)), FullConfig()))
    with pytest.raises(NotImplementedError, match="rope_type 'longrope'"):
        check_supported(net)
