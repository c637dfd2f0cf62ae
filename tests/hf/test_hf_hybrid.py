"""Models whose layers are already local or global (Gemma-2/3, OLMo-3, gpt-oss, Command-R7B; the published
configs of ``real_configs``, shrunk): conversion keeps the sliding-window layers as they are, the mechanism
goes on the full-attention layers, the softmax of every layer keeps its sink logits and soft-capping, and the
share of (layer, head, token) triples reading the whole prefix is reported before and after."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhere import AHAConfig, set_forced_gate  # noqa: E402
from allhere.cli import main  # noqa: E402
from allhere.hf import (  # noqa: E402
    collect_routing,
    convert,
    global_share,
    load_pretrained,
    save_pretrained,
)
from allhere.hf.convert import attention_modules  # noqa: E402

from helpers import rel_err  # noqa: E402
from hf_fixtures import write_model, write_texts  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    names = ("Gemma-2-2B-it", "Gemma-3-1B-it", "gpt-oss-20b", "OLMo-3-7B")
    return {name: write_model(name, root / name) for name in names}


def fp32(folder, attn_implementation=None, **overrides):
    config = transformers.AutoConfig.from_pretrained(str(folder))
    for k, v in overrides.items():
        setattr(config, k, v)
    impl = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                             **impl).eval()


def ids_for(model, n=40):
    return torch.randint(7, model.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(3))


def test_sliding_layers_stay_and_the_global_share_is_reported(folders, tmp_path):
    """Gemma-3 (5 sliding : 1 full): AHA on layer 5 only; 1/6 of the triples read the whole prefix before,
    mu_f / 6 after; the routing statistics name layer 5; saved and loaded, the same layers are converted."""
    model = convert(fp32(folders["Gemma-3-1B-it"]), AHAConfig(window=4, router_init="neutral"))
    kinds = model.config.layer_types
    assert kinds.count("full_attention") == 1 and len(kinds) == 6
    assert [hasattr(a, "allhere") for a in attention_modules(model)] == [k == "full_attention" for k in kinds]
    ids = ids_for(model)
    with torch.no_grad():
        out = model(ids).logits
        routing = collect_routing(model)
        assert routing.layers == [kinds.index("full_attention")]
        share = global_share(model)
        mu_f = float(routing.mu_f())
        assert 0 < mu_f < 1
        assert share["before"] == pytest.approx(1 / 6) and share["after"] == pytest.approx(mu_f / 6)
        set_forced_gate(model, False)
        model(ids)
        assert global_share(model)["after"] == 0.0
        set_forced_gate(model, None)
        save_pretrained(model, tmp_path / "m")
        again = load_pretrained(tmp_path / "m", dtype=torch.float32).eval()
        assert [hasattr(a, "allhere") for a in attention_modules(again)] == [k == "full_attention" for k in kinds]
        assert torch.equal(again(ids).logits, out)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "Gemma-2-2B-it"])
def test_sinks_and_softcapping_enter_both_attentions(folders, name):
    """gpt-oss (a learned sink logit per head in every softmax) and Gemma-2 (soft-capped scores): AHA with the
    model's own window and every gate local is the same model with every layer sliding, computed by
    transformers' own code; every gate global is the original. Mixed gates train (gradient to the router)."""
    folder = folders[name]

    def load(**overrides):  # q/k weights x 30: scores well past Gemma-2's cap of 50, so that soft-capping shows
        # eager: the family's own softmax terms (transformers 5.17 ran Gemma-2 through SDPA, dropping the cap)
        m = fp32(folder, attn_implementation="eager", **overrides)
        with torch.no_grad():
            for attn in attention_modules(m):
                attn.q_proj.weight.mul_(30.0)
                attn.k_proj.weight.mul_(30.0)
        return m

    original = load()
    window = original.config.sliding_window
    all_sliding = load(layer_types=["sliding_attention"] * original.config.num_hidden_layers)
    ids = ids_for(original)
    if name.startswith("Gemma-2"):
        with torch.no_grad():
            uncapped = load(attn_logit_softcapping=None)
            assert rel_err(uncapped(ids).logits, original(ids).logits) > 1e-2  # the cap is felt
    model = convert(load(), AHAConfig(window=window, router_init="neutral"))
    with torch.no_grad():
        set_forced_gate(model, True)
        assert rel_err(model(ids).logits, original(ids).logits) < 1e-5
        set_forced_gate(model, False)
        local = model(ids).logits
        assert rel_err(local, all_sliding(ids).logits) < 1e-5
        assert rel_err(local, original(ids).logits) > 1e-3  # the window is felt at 40 tokens
    set_forced_gate(model, None)
    model(ids).logits.float().pow(2).mean().backward()
    router = next(m for m in model.modules() if hasattr(m, "router")).router
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def one_line(capfd) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_refusals_name_what_is_missing(folders, tmp_path, capfd):
    """--layers all on a model of config.layer_types, and DAR where a softmax has sinks: one line, exit 2,
    nothing written."""
    out = tmp_path / "o"
    assert main(["convert", "--model", str(folders["OLMo-3-7B"]), "--out", str(out), "--mechanism", "aha",
                 "--window", "4", "--layers", "all"]) == 2
    assert "config.layer_types" in one_line(capfd) and not out.exists()
    assert main(["convert", "--model", str(folders["gpt-oss-20b"]), "--out", str(out), "--mechanism", "dar",
                 "--window", "4", "--d-down", "16"]) == 2
    assert "sink" in one_line(capfd) and not out.exists()
    assert main(["convert", "--model", str(folders["gpt-oss-20b"]), "--out", str(out), "--mechanism", "aha",
                 "--window", "4"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["allhere_layers"] == [1] and saved["layer_types"] == ["sliding_attention", "full_attention"]


def test_perplexity_reports_the_share_before_and_after(folders, tmp_path, capsys):
    """allhere perplexity on Gemma-3 converted to AHA with every router open: mu_f 100% on the full layer,
    1/6 of the triples read the whole prefix before and after."""
    out = tmp_path / "aha"
    assert main(["convert", "--model", str(folders["Gemma-3-1B-it"]), "--out", str(out), "--mechanism", "aha",
                 "--window", "4"]) == 0
    capsys.readouterr()
    assert main(["perplexity", "--model", str(out), "--data", str(write_texts(tmp_path / "texts")), "--seq-len",
                 "32", "--no-progress"]) == 0
    line = capsys.readouterr().out
    assert "mu_f 100.0%" in line and "16.7% before conversion, 16.7% after" in line, line


@pytest.mark.parametrize("name", ["Gemma-3-1B-it", "gpt-oss-20b", "OLMo-3-7B"])
def test_cached_generation_of_a_left_padded_batch_is_the_originals(folders, name):
    """Every gate global: greedy generation of a left-padded batch, with transformers' cache (rolling on the
    sliding layers), equals the original model's, token for token."""
    original = fp32(folders[name])
    model = convert(fp32(folders[name]), AHAConfig(window=4))
    set_forced_gate(model, True)
    ids = ids_for(original, n=20)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kw), original.generate(ids, **kw))
