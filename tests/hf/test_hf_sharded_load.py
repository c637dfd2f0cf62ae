"""``allhere.hf.sharded_load``: a Hugging Face folder loaded straight into FSDP2 shards (2 gloo processes)
equals the single-process ``load_local`` + ``convert(..., seed=)`` model, weights, buffers and logits, and
holds less than the whole model at any time of the load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhere import AHAConfig, ConfigError, DARConfig, registry  # noqa: E402
from allhere.hf import convert, save_pretrained  # noqa: E402
from allhere.hf.convert import init_mechanism  # noqa: E402
from allhere.hf.io import load_local  # noqa: E402
from allhere.hf.sharded_load import PeakRSS, load_sharded  # noqa: E402
from allhere.mechanisms.base import AttentionDims  # noqa: E402
from allhere.runtime.model_checkpoint import CheckpointError  # noqa: E402

from dist_worker import launch  # noqa: E402
from hf_fixtures import write_model  # noqa: E402

pytestmark = pytest.mark.slow  # two ranks per fixture: about a minute in all

SEED = 7
AHA = AHAConfig(window=4, router_init="neutral")  # random router weights: a seed that missed them would show
DAR = DARConfig(window=4, d_down=16)  # a random orthonormal bottleneck
# (case, folder, mechanism): tied + llama3 rope scaling + bf16 files in shards; tied + q/k norm + head_dim !=
# hidden / heads; a hybrid (sliding layers kept) with YaRN; a plain untied one; one saved converted
CASES = [("llama-aha", "llama", AHA), ("qwen3-dar", "qwen3", DAR), ("olmo3-aha", "olmo3", AHA),
         ("olmo2-plain", "olmo2", None), ("saved-aha", "saved", None)]
TIED = {"llama-aha", "qwen3-dar"}


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


def _correctness(rank, world, tmp, folders, broken):
    """Every case loaded sharded; rank 0 also loads the single-process model and compares."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    out = {}
    for case, key, mech in CASES:
        tok, model = load_sharded(folders[key], mech, seed=SEED)
        report = model.allhere_load_report
        res = {"tied": model.lm_head.weight is model.get_input_embeddings().weight,
               "dtensor": type(model.lm_head.weight).__name__, "full_bytes": report.full_model_bytes,
               "local_bytes": report.local_bytes, "tokenizer": len(tok),
               "peak": (report.peak_rss_delta_bytes, report.peak_source)}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        ids = _ids(model.config.vocab_size)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        if rank == 0:
            _, ref = load_local(folders[key], dtype=torch.float32)
            if mech is not None:
                convert(ref, mech, seed=SEED)
            sd = ref.state_dict()
            res["keys"] = sorted(set(sd) ^ set(full))
            res["unequal"] = sorted(k for k in sd if k in full and not torch.equal(sd[k], full[k]))
            res["n_mech"] = sum(".allhere." in k for k in full)
            mine = dict(model.named_buffers())
            res["buffers"] = sorted(k for k, b in ref.named_buffers() if not torch.equal(b, mine[k]))
            with torch.no_grad():
                res["logits"] = float((ref(input_ids=ids).logits - logits).abs().max())
        out[case] = res
    errors = {}
    for what, folder in broken.items():
        try:
            load_sharded(folder, AHA)
            errors[what] = "no error"
        except (CheckpointError, ConfigError) as e:
            errors[what] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_load")
    f = {"llama": write_model("Llama-3.2-1B", root / "llama", shards=True, init_std=0.1),
         "qwen3": write_model("Qwen3-0.6B", root / "qwen3", init_std=0.1),
         "olmo3": write_model("OLMo-3-7B", root / "olmo3", init_std=0.1),
         "olmo2": write_model("OLMo-2-1B", root / "olmo2", init_std=0.1)}
    tok, model = load_local(f["llama"], dtype=torch.float32)
    convert(model, AHAConfig(window=4), layers=[1])
    with torch.no_grad():  # weights no initialisation gives: they can only come from the files
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_pretrained(model, root / "saved")
    tok.save_pretrained(str(root / "saved"))
    f["saved"] = root / "saved"
    _, olmo = load_local(f["olmo2"], dtype=torch.float32)
    save_pretrained(convert(olmo, AHAConfig(window=4, router_bias=False)), root / "fa", format="faolmo")
    broken = {"faolmo": root / "fa"}
    for what in ("missing", "corrupt", "truncated", "shape"):
        shutil.copytree(f["llama" if what == "missing" else "olmo2"], root / what)
        broken[what] = root / what
    shard = sorted((root / "missing").glob("model-*.safetensors"))[1]
    shard.unlink()
    data = (root / "corrupt" / "model.safetensors").read_bytes()
    (root / "corrupt" / "model.safetensors").write_bytes(b"\xff" * 16 + data[16:])
    (root / "truncated" / "model.safetensors").write_bytes(
        (root / "truncated" / "model.safetensors").read_bytes()[:-1000])
    config = json.loads((root / "shape" / "config.json").read_text())
    (root / "shape" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    return {k: str(v) for k, v in f.items()}, {k: str(v) for k, v in broken.items()}, shard.name


@pytest.fixture(scope="module")
def results(folders, tmp_path_factory):
    good, broken, _ = folders
    return launch(_correctness, 2, tmp_path_factory.mktemp("ranks"), good, broken)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_gathered_state_buffers_and_logits_equal_single_process(results, case):
    ref = results[0][case]
    assert ref["keys"] == [] and ref["unequal"] == [] and ref["buffers"] == []
    assert ref["logits"] <= 1e-5
    if case in ("llama-aha", "qwen3-dar", "olmo3-aha", "saved-aha"):
        assert ref["n_mech"] > 0  # the mechanism weights are among the compared ones
    for rank in results:  # sharded: each rank holds about half of the parameters
        assert rank[case]["dtensor"] == "DTensor"
        assert rank[case]["local_bytes"] < 0.6 * rank[case]["full_bytes"]
        assert rank[case]["peak"] == (None, "not measured")  # memory is measured only when asked (a side effect)


@pytest.mark.parametrize("case", sorted(TIED))
def test_tied_embeddings_stay_one_parameter(results, case):
    assert all(rank[case]["tied"] for rank in results)


def test_errors_name_the_file(results, folders):
    _, broken, missing_shard = folders
    for rank in results:
        e = rank["errors"]
        assert e["faolmo"].startswith("ConfigError") and "faolmo" in e["faolmo"]
        assert e["missing"].startswith("CheckpointError") and missing_shard in e["missing"]
        for what in ("corrupt", "truncated"):
            assert e[what].startswith("CheckpointError") and "model.safetensors" in e[what], e[what]
        assert e["shape"].startswith("CheckpointError") and "mlp" in e["shape"] and "[128" in e["shape"]
        assert all("\n" not in m for m in e.values())


def test_needs_a_process_group(folders):
    with pytest.raises(RuntimeError, match="process group"):
        load_sharded(folders[0]["olmo2"])


# the seeded initialisation of mechanism weights --------------------------------------------------------

@pytest.mark.parametrize("kind", [k for k in registry.kinds() if registry.get(k).module.hf_support])
def test_seeded_init_depends_on_seed_and_layer_only(kind):
    cfg = {"aha": AHA, "dar": DAR}.get(kind) or registry.get(kind).config()
    dims = AttentionDims(64, 4, 2, 16)
    torch.manual_seed(1)
    a = init_mechanism(registry.build(cfg, dims), SEED, 3)
    torch.manual_seed(2)
    b = registry.build(cfg, dims)  # its own unseeded init draws from the global generator
    state = torch.get_rng_state()
    init_mechanism(b, SEED, 3)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left alone
    other = init_mechanism(registry.build(cfg, dims), SEED, 4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), other.parameters()):
        assert torch.equal(p, q), name
        assert not torch.equal(p, r) or p.std() == 0, name  # random parts differ between layers


def test_convert_with_seed_is_reproducible(folders):
    models = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        _, model = load_local(folders[0]["qwen3"], dtype=torch.float32)
        models.append(convert(model, DAR, seed=SEED).state_dict())
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


# peak memory ---------------------------------------------------------------------------------------------

def _peak_sharded(rank, world, tmp, folder):
    import transformers.models.llama.modeling_llama  # noqa: F401  (a first import costs ~100 MB with 5.17)

    _, model = load_sharded(folder, measure_memory=True)
    r = model.allhere_load_report
    return {"delta": r.peak_rss_delta_bytes, "full": r.full_model_bytes, "local": r.local_bytes,
            "source": r.peak_source}


def _peak_local(rank, world, tmp, folder):
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before, as for the ranks)

    with PeakRSS() as peak:
        _, model = load_local(folder, dtype=torch.float32)
    return {"delta": peak.delta, "full": sum(p.numel() * p.element_size() for p in model.parameters())}


def test_peak_memory_per_rank_is_below_the_model(tmp_path):
    # 53M parameters (212 MB in fp32, 106 MB of bf16 files), most of them in the tied embedding
    folder = write_model("Llama-3.2-1B", tmp_path / "wide", vocab_size=46000, hidden_size=1024, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128)
    sharded = launch(_peak_sharded, 2, tmp_path / "ranks", str(folder))
    single = launch(_peak_local, 1, tmp_path / "single", str(folder))[0]
    full = single["full"]
    assert full > 150e6 and all(r["full"] == full for r in sharded)
    assert single["delta"] >= full  # the measurement sees a whole model where one is loaded
    for r in sharded:
        assert 0.9 * r["local"] <= r["delta"] < 0.8 * full, (r, full)
