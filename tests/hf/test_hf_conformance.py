"""The user path on the checkpoints users pick: the published config.json of each (``real_configs``; tied
embeddings, llama3 rope scaling, q/k/v bias, q/k norm, head_dim != hidden / heads, 9 query over 3 KV heads,
a sliding window, partial rotary and parallel residual), shrunk to tiny sizes, weights in the published
dtype, one of them sharded. Each goes through conversion (forced-global / wide windows give the original
logits), ``allhere convert``, ``allhere sft``, ``load_pretrained``, generation with and without the cache,
``allhere perplexity`` and ``allhere eval``. Flags allhere cannot honour are refused in one line."""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from allhere import AHAConfig, DARConfig, SinksConfig, SlidingConfig, set_forced_gate  # noqa: E402
from allhere.cli import main  # noqa: E402
from allhere.hf import convert, load_pretrained, save_pretrained  # noqa: E402
from allhere.hf.convert import (  # noqa: E402
    LENGTH_DEPENDENT_ROPE,
    attention_modules,
    rope_types,
    softmax_extras,
)
from allhere.hf.io import saved_dtype  # noqa: E402
from allhere.runtime.model_checkpoint import read_checkpoint  # noqa: E402
from allhere.validation import ConfigError  # noqa: E402

from helpers import rel_err  # noqa: E402
from hf_fixtures import write_chat, write_model, write_texts  # noqa: E402
from real_configs import ALL_NAMES as NAMES  # noqa: E402
from real_configs import PUBLISHED, stored_dtype, tied  # noqa: E402

SHARDED = "Qwen3-0.6B"  # saved as model-0000x-of-0000y.safetensors + index, as the big ones are
# Every layer of Mistral-7B-v0.1 has a sliding window (4096): there is no full-attention layer for the default
# layers="full", so its mechanisms go on every layer, in place of the window (shorter than the tests' sequences)
LAYERS = {"Mistral-7B-v0.1": "all"}


def layers_of(name):
    return LAYERS.get(name, "full")
TASKS = Path(__file__).resolve().parents[1] / "lm_eval_tasks"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    models = {name: write_model(name, root / name, shards=name == SHARDED) for name in NAMES}
    data = {"chat": write_chat(root / "chat.jsonl"), "texts": write_texts(root / "texts")}
    text = (TASKS / "tiny_rolling.yaml").read_text().replace("tests/lm_eval_tasks/", str(TASKS) + "/")
    (root / "tasks").mkdir()
    (root / "tasks" / "tiny_rolling.yaml").write_text(text)
    data["tasks"] = root / "tasks"
    return models, data


def fp32(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def ids_for(model, n=40, batch=2):
    return torch.randint(7, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(1))


def test_the_fixtures_carry_the_published_flags(folders):
    models, _ = folders
    for name in NAMES:
        folder = models[name]
        config = transformers.AutoConfig.from_pretrained(str(folder))
        assert saved_dtype(config, folder) == getattr(torch, stored_dtype(name)), name
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
        shared = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert shared == tied(name), name
        scaling = PUBLISHED[name].get("rope_scaling") or {}
        published = scaling.get("rope_type", scaling.get("type"))
        if published:  # the rope type as published (llama3, yarn, linear, longrope) is the one transformers builds
            assert published in rope_types(config), name
    assert len(list(models[SHARDED].glob("model-*-of-*.safetensors"))) > 1
    assert (models[SHARDED] / "model.safetensors.index.json").exists()


def plain_softmax(model) -> bool:
    """Whether no layer's softmax has sinks or soft-capping (gpt-oss, Gemma-2 have them)."""
    return not any(softmax_extras(attn) for attn in attention_modules(model))


@pytest.mark.parametrize("name", NAMES)
def test_conversions_keep_the_original_logits(folders, name):
    """AHA (forced global, and its all-open initial routers), DAR with d_down = d, and sliding / sinks with a
    window covering the sequence compute what the original computes; forced local AHA = sliding. Where a
    layer's softmax has sink logits or soft-capping, AHA computes them too and the others are refused."""
    folder = folders[0][name]
    ref_model = fp32(folder)
    ids = ids_for(ref_model)
    layers = layers_of(name)
    plain = plain_softmax(ref_model)
    with torch.no_grad():
        ref = ref_model(ids).logits
        d = ref_model.config.hidden_size
        for mech in (AHAConfig(window=4), DARConfig(window=4, d_down=d), SlidingConfig(window=ids.shape[1]),
                     SinksConfig(window=ids.shape[1] - 2, n_sinks=2)):
            refusal = "does not compute" if not plain and not isinstance(mech, AHAConfig) else None
            if isinstance(mech, DARConfig) and rope_types(ref_model.config) & LENGTH_DEPENDENT_ROPE:
                refusal = "changes the rotary frequencies with the sequence length"  # Phi-4-mini's longrope
            if refusal:
                with pytest.raises(ConfigError, match=refusal):
                    convert(fp32(folder), mech, layers=layers)
                continue
            model = convert(fp32(folder), mech, layers=layers)
            if isinstance(mech, AHAConfig):
                set_forced_gate(model, True)
            assert rel_err(model(ids).logits, ref) < 1e-5, mech
        local = convert(fp32(folder), AHAConfig(window=5), layers=layers)
        set_forced_gate(local, False)
        assert rel_err(local(ids).logits, ref) > 1e-3  # the window is felt at 40 tokens
        if plain:
            sliding = convert(fp32(folder), SlidingConfig(window=5), layers=layers)
            assert rel_err(local(ids).logits, sliding(ids).logits) < 1e-5


@pytest.mark.parametrize("name", ["Llama-3.2-1B", "Pythia-160M"])
def test_conversion_in_the_published_dtype(folders, name):
    """Loaded as published (bf16 / fp16), forced-global AHA gives the original's logits in that dtype."""
    folder = folders[0][name]
    original = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert original.dtype != torch.float32
    ids = ids_for(original)
    with torch.no_grad():
        ref = original(ids).logits
        model = convert(transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval(), AHAConfig(window=4))
        set_forced_gate(model, True)
        assert rel_err(model(ids).logits, ref) < 2e-2  # one rounding of the half-precision attention


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_user_path(folders, name, tmp_path, capsys):
    """convert -> sft -> load_pretrained -> generate (cache = no cache) -> perplexity -> eval."""
    models, data = folders
    folder = models[name]
    published = getattr(torch, stored_dtype(name))
    layers = ["--layers", layers_of(name)]
    run_cli(["convert", "--model", folder, "--out", tmp_path / "aha", "--mechanism", "aha", "--window", 4, *layers],
            capsys)
    run_cli(["sft", "--model", folder, "--data", data["chat"], "--out", tmp_path / "sft", "--window", 4, *layers,
             "--seq-len", 48, "--batch-size", 2, "--global-batch", 4, "--max-steps", 2, "--lr", 1e-3,
             "--no-progress"], capsys)
    tuned = load_pretrained(tmp_path / "sft" / "model").eval()
    assert tuned.dtype == published  # trained in float32, saved as published
    if tied(name):
        assert tuned.get_output_embeddings().weight is tuned.get_input_embeddings().weight
    trained, _ = read_checkpoint(tmp_path / "sft" / "checkpoint.safetensors")  # float32 master weights
    base = fp32(folder).state_dict()
    assert all(trained[f"model.hf.{k}"].dtype == torch.float32 for k in base)
    assert sum(not torch.equal(trained[f"model.hf.{k}"], v) for k, v in base.items()) > len(base) // 2
    assert any(".allhere." in k for k in trained)
    for k, v in tuned.state_dict().items():  # the saved model: the trained weights in the published dtype
        assert torch.equal(v, trained[f"model.hf.{k}"].to(published)), k
    prompt = ids_for(tuned, n=6, batch=2)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tuned.config.pad_token_id)
    with torch.no_grad():
        tuned.float()
        assert torch.equal(tuned.generate(prompt, use_cache=True, **kw), tuned.generate(prompt, use_cache=False, **kw))
    out = run_cli(["perplexity", "--model", tmp_path / "sft" / "model", "--data", data["texts"], "--seq-len", 32,
                   "--no-progress"], capsys)
    assert "mu_f" in out and "perplexity" in out
    out = run_cli(["eval", "--model", tmp_path / "aha", "--tasks", "allhere_tiny_rolling", "--include-path",
                   data["tasks"], "--limit", 2, "--no-progress"], capsys)
    assert "allhere_tiny_rolling" in out and "mu_f" in out


def test_sharded_converted_model_saves_and_loads(folders, tmp_path):
    model = convert(fp32(folders[0][SHARDED]), AHAConfig(window=4, router_init="neutral"))
    save_pretrained(model, tmp_path / "m", max_shard_size="20KB")
    assert len(list((tmp_path / "m").glob("model-*-of-*.safetensors"))) > 1
    again = load_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    ids = ids_for(model)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def one_line(capfd) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def edited(folder, tmp_path, **changes):
    """A copy of the config.json of ``folder`` (weights and tokenizer linked) with ``changes``."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).symlink_to(f)
    (copy / "config.json").unlink()
    cfg = {**json.loads((folder / "config.json").read_text()), **changes}
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def test_qwen_sliding_window_layers_keep_their_window(folders, tmp_path, capsys):
    """Qwen2 with use_sliding_window and max_window_layers: the layers from max_window_layers on keep their
    window (and transformers' rolling cache), AHA goes on the others; forced global = the original."""
    folder = edited(folders[0]["Qwen2.5-0.5B"], tmp_path, use_sliding_window=True, max_window_layers=1,
                    sliding_window=16)
    original = fp32(folder)
    assert original.config.layer_types == ["full_attention", "sliding_attention"]
    model = convert(fp32(folder), AHAConfig(window=4))
    assert [hasattr(a, "allhere") for a in attention_modules(model)] == [True, False]
    set_forced_gate(model, True)
    ids = ids_for(original)
    with torch.no_grad():
        assert rel_err(model(ids).logits, original(ids).logits) < 1e-5
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:, :20], **kw), original.generate(ids[:, :20], **kw))
    run_cli(["convert", "--model", folder, "--out", tmp_path / "o", "--mechanism", "aha", "--window", 4], capsys)
    again = load_pretrained(tmp_path / "o", dtype=torch.float32)
    assert again.config.layer_types == ["full_attention", "sliding_attention"]
    assert [hasattr(a, "allhere") for a in attention_modules(again)] == [True, False]


def test_unknown_rope_type_is_refused(folders, tmp_path, capfd):
    scaling = {**PUBLISHED["Llama-3.2-1B"]["rope_scaling"], "rope_type": "llama9"}
    folder = edited(folders[0]["Llama-3.2-1B"], tmp_path, rope_scaling=scaling)
    for command in (["perplexity", "--model", str(folder)], ["convert", "--model", str(folder), "--out",
                                                              str(tmp_path / "o"), "--mechanism", "aha",
                                                              "--window", "4"]):
        assert main(command) == 2
        assert "rope_type 'llama9'" in one_line(capfd)


def test_dar_refuses_a_length_dependent_rope(folders, tmp_path, capfd):
    folder = edited(folders[0]["Llama-3.1-8B"], tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert main(["convert", "--model", str(folder), "--out", str(tmp_path / "o"), "--mechanism", "dar",
                 "--window", "4", "--d-down", "16"]) == 2
    assert "rope_type 'dynamic'" in one_line(capfd)
    assert main(["convert", "--model", str(folder), "--out", str(tmp_path / "o"), "--mechanism", "aha",
                 "--window", "4"]) == 0  # AHA rotates every key as the original does


def test_mistral_window_replaced_is_said(folders, tmp_path, capfd):
    """Every layer of Mistral-7B-v0.1 is sliding: the default (full layers only) is refused in one line naming
    --layers all, which converts them all and says the window is replaced."""
    command = ["convert", "--model", str(folders[0]["Mistral-7B-v0.1"]), "--out", str(tmp_path / "o"),
               "--mechanism", "aha", "--window", "4"]
    assert main(command) == 2
    assert "--layers all" in one_line(capfd) and not (tmp_path / "o").exists()
    assert main([*command, "--layers", "all"]) == 0
    err = capfd.readouterr().err
    assert "sliding window of 4096" in err and "whole prefix" in err
