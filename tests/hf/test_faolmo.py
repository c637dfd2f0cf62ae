"""The AHA authors' checkpoint format ("faolmo", an OLMo-2 whose q_proj carries the router rows): loaded
without its remote code against a reference forward written here from the format's description, saved back
tensor for tensor, an OLMo-2 converted by allhere written in it, what it cannot hold refused in one line,
and the CLI. Tiny sizes, bf16 weights as published, built here (no downloads)."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from allhere import AHAConfig, DARConfig  # noqa: E402
from allhere.cli import main  # noqa: E402
from allhere.hf import collect_routing, convert, load_pretrained, save_pretrained  # noqa: E402
from allhere.hf.io import check_causal_lm, load_local  # noqa: E402
from allhere.runtime.model_checkpoint import CheckpointError  # noqa: E402
from allhere.validation import ConfigError  # noqa: E402

from helpers import rel_err  # noqa: E402
from hf_fixtures import make_tokenizer, write_model, write_texts  # noqa: E402

H, D, HIDDEN, LAYERS, INTER, WINDOW, THETA, EPS = 4, 32, 128, 2, 96, 4, 10000.0, 1e-6
N = 24  # tokens per sequence: longer than the window


def faolmo_config(vocab: int, kv: int) -> dict:
    """config.json with the format's field names (OLMo-2's, plus model_type / architectures / auto_map /
    local_window_size)."""
    tok = make_tokenizer()
    return {"architectures": ["FAOlmoForCausalLM"], "model_type": "faolmo",
            "auto_map": {"AutoConfig": "configuration_faolmo.FAOlmoConfig",
                         "AutoModelForCausalLM": "modeling_faolmo.FAOlmoForCausalLM"},
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
            "intermediate_size": INTER, "local_window_size": WINDOW, "max_position_embeddings": 256,
            "num_attention_heads": H, "num_hidden_layers": LAYERS, "num_key_value_heads": kv, "rms_norm_eps": EPS,
            "rope_scaling": None, "rope_theta": THETA, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, "vocab_size": vocab}


def write_faolmo(folder, kv: int = H, shards: bool = False, seed: int = 0, **changes):
    """A faolmo folder (config.json, bf16 safetensors, tokenizer); returns (folder, the tensors written).
    Router rows of std 0.3 on inputs of std ~1: gates well away from the threshold, mixed per (token, head)."""
    tok = make_tokenizer()
    vocab = len(tok)
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.05, one=False):
        return ((1.0 if one else 0.0) + torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(vocab, HIDDEN, std=1.0), "model.norm.weight": r(HIDDEN, one=True),
         "lm_head.weight": r(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": torch.cat([r(H * D, HIDDEN), r(H, HIDDEN, std=0.3)]),
              p + "self_attn.k_proj.weight": r(kv * D, HIDDEN), p + "self_attn.v_proj.weight": r(kv * D, HIDDEN),
              p + "self_attn.o_proj.weight": r(HIDDEN, H * D), p + "self_attn.q_norm.weight": r(H * D, one=True),
              p + "self_attn.k_norm.weight": r(kv * D, one=True), p + "mlp.gate_proj.weight": r(INTER, HIDDEN),
              p + "mlp.up_proj.weight": r(INTER, HIDDEN), p + "mlp.down_proj.weight": r(HIDDEN, INTER),
              p + "post_attention_layernorm.weight": r(HIDDEN, one=True),
              p + "post_feedforward_layernorm.weight": r(HIDDEN, one=True)}
    if changes.get("tie_word_embeddings"):
        del t["lm_head.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**faolmo_config(vocab, kv), **changes}, indent=2))
    if shards:  # model-0000x-of-00002.safetensors + index, as big checkpoints are published
        names = list(t)
        parts = [names[: len(names) // 2], names[len(names) // 2:]]
        files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
        for f, part in zip(files, parts):
            save_file({k: t[k] for k in part}, str(folder / f), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: f for f, part in zip(files, parts) for k in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(folder))
    return folder, t


# the reference: the format's description in plain torch, float32 -------------------------------------

def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x):
    """x [b, heads, n, D] rotated by position (rotate-half pairs (i, i + D/2), theta from the config)."""
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def reference(t, ids, kv: int, window: int = WINDOW):
    """(logits [b, n, vocab], gates [layers, b, H, n]): embeddings; per layer q = x Wq (first H*D rows of
    q_proj), router logits = x Wr (last H rows), q_norm / k_norm over all heads, RoPE, per (token, head)
    the whole causal prefix when sigmoid(logit) > 0.5 else the last ``window`` keys, o_proj, then the
    post-norms on the residual (attention, then SwiGLU MLP); final norm, lm_head."""
    w = {k: v.float() for k, v in t.items()}
    x = w["model.embed_tokens.weight"][ids]
    b, n, _ = x.shape
    i = torch.arange(n)
    causal, near = i[:, None] >= i[None, :], (i[:, None] - i[None, :]) < window
    gates = []
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        qr = x @ w[p + "self_attn.q_proj.weight"].T
        q, logits = qr[..., : H * D], qr[..., H * D:]
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]).view(b, n, H, D).transpose(1, 2))
        k = rope(rms(x @ w[p + "self_attn.k_proj.weight"].T, w[p + "self_attn.k_norm.weight"])
                 .view(b, n, kv, D).transpose(1, 2))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, n, kv, D).transpose(1, 2)
        k, v = k.repeat_interleave(H // kv, 1), v.repeat_interleave(H // kv, 1)
        g = (torch.sigmoid(logits) > 0.5).transpose(1, 2)  # [b, H, n]
        allowed = causal & (g[..., None] | near)  # [b, H, n, n]
        s = (q @ k.transpose(-1, -2)) / D ** 0.5
        a = s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        o = a.transpose(1, 2).reshape(b, n, H * D) @ w[p + "self_attn.o_proj.weight"].T
        x = x + rms(o, w[p + "post_attention_layernorm.weight"])
        m = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"].T
        x = x + rms(m, w[p + "post_feedforward_layernorm.weight"])
        gates.append(g)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # tie_word_embeddings: no lm_head
    return rms(x, w["model.norm.weight"]) @ head.T, torch.stack(gates)


def ids_for(vocab: int, seed: int = 1):
    return torch.randint(7, vocab, (2, N), generator=torch.Generator().manual_seed(seed))


def gates_of(model):
    return torch.stack([layer.gates for layer in collect_routing(model).per_layer])


# (a) loading ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv,shards,tied", [(H, False, False), (2, True, False), (H, False, True)],
                         ids=["mha", "gqa-sharded", "tied-embeddings"])
def test_load_matches_the_formats_reference(tmp_path, kv, shards, tied):
    folder, t = write_faolmo(tmp_path / "fa", kv=kv, shards=shards, **({"tie_word_embeddings": True} if tied else {}))
    ids = ids_for(t["model.embed_tokens.weight"].shape[0])
    ref, ref_gates = reference(t, ids, kv)
    assert ref_gates.any() and not ref_gates.all()  # mixed: some (token, head) global, some local
    assert rel_err(reference(t, ids, kv, window=N)[0], ref) > 1e-2  # the local heads matter
    model = load_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "Olmo2ForCausalLM" and model.config.model_type == "olmo2"
    with torch.no_grad():
        logits = model(ids).logits
    assert rel_err(logits, ref) < 1e-4
    assert torch.equal(gates_of(model), ref_gates)  # routing statistics of the last forward
    assert collect_routing(model).per_layer[0].scores.shape == (2, H, N)
    auto = load_pretrained(folder)  # dtype as saved
    assert auto.dtype == torch.bfloat16 and auto.model.rotary_emb.inv_freq.dtype == torch.float32
    save_pretrained(auto, tmp_path / "again", format="faolmo")
    assert load_file(str(tmp_path / "again" / "model.safetensors")).keys() == t.keys()  # no lm_head when tied


def test_check_causal_lm_and_load_local_read_the_format(tmp_path):
    folder, t = write_faolmo(tmp_path / "fa")
    config = check_causal_lm(folder, convertible=True)
    assert config.model_type == "olmo2" and config.rope_parameters["rope_theta"] == THETA
    tok, model = load_local(folder)
    assert model.dtype == torch.bfloat16 and len(tok) == t["model.embed_tokens.weight"].shape[0]


# (b) round trip ------------------------------------------------------------------------------------------

def test_round_trip_gives_the_same_files_and_logits(tmp_path):
    folder, t = write_faolmo(tmp_path / "fa")
    model = load_pretrained(folder)
    ids = ids_for(t["model.embed_tokens.weight"].shape[0])
    with torch.no_grad():
        before = model(ids).logits
    save_pretrained(model, tmp_path / "out", format="faolmo")
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert saved.keys() == t.keys()
    for k, v in t.items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == json.loads((folder / "config.json").read_text())
    save_pretrained(load_pretrained(tmp_path / "out"), tmp_path / "sharded", format="faolmo", max_shard_size=60_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for again in (tmp_path / "out", tmp_path / "sharded"):
        with torch.no_grad():
            assert torch.equal(load_pretrained(again)(ids).logits, before)
    other, _ = write_faolmo(tmp_path / "other", seed=5)  # saved over the sharded folder as one file:
    save_pretrained(load_pretrained(other), tmp_path / "sharded", format="faolmo")  # no stale index or shard left
    assert sorted(p.name for p in (tmp_path / "sharded").glob("model*")) == ["model.safetensors"]
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "sharded")(ids).logits, load_pretrained(other)(ids).logits)


# (c) an OLMo-2 converted by allhere, written in the format --------------------------------------------

def test_converted_olmo2_saved_as_faolmo(tmp_path):
    folder = write_model("OLMo-2-1B", tmp_path / "olmo")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    convert(model, AHAConfig(window=3, router_bias=False))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.allhere.router.weight.normal_(0.0, 0.5)
    ids = ids_for(model.config.vocab_size)
    with torch.no_grad():
        before = model(ids).logits
    gates = gates_of(model)
    assert gates.any() and not gates.all()
    save_pretrained(model, tmp_path / "fa", format="faolmo")
    config = json.loads((tmp_path / "fa" / "config.json").read_text())
    assert config["model_type"] == "faolmo" and config["architectures"] == ["FAOlmoForCausalLM"]
    assert config["local_window_size"] == 3 and config["rope_theta"] == 500000
    q = load_file(str(tmp_path / "fa" / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    attn = model.model.layers[1].self_attn
    assert torch.equal(q, torch.cat([attn.q_proj.weight, attn.allhere.router.weight]))
    loaded = load_pretrained(tmp_path / "fa")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
    assert torch.equal(gates_of(loaded), gates)


# (d) refusals --------------------------------------------------------------------------------------------

def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    return write_model("OLMo-2-1B", tmp_path_factory.mktemp("olmo2"))


def olmo(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder))


@pytest.mark.parametrize("case,match", [
    ("llama", "OLMo-2"), ("unconverted", "not converted"), ("router_bias", "router_bias=False"),
    ("tau", "tau"), ("dar", "AHA routers"), ("one_layer", "layer 1 has no AHA router")])
def test_what_the_format_cannot_hold_is_refused(olmo2, tmp_path, case, match):
    if case == "llama":
        model = convert(olmo(write_model("Llama-3.2-1B", tmp_path / "llama")), AHAConfig(window=4, router_bias=False))
    else:
        model = olmo(olmo2)
        cfg = {"router_bias": AHAConfig(window=4), "tau": AHAConfig(window=4, tau=0.3, router_bias=False),
               "dar": DARConfig(window=4, d_down=16)}.get(case, AHAConfig(window=4, router_bias=False))
        if case != "unconverted":
            convert(model, cfg, **({"layers": [0]} if case == "one_layer" else {}))
    with pytest.raises(ConfigError) as e:
        save_pretrained(model, tmp_path / "out", format="faolmo")
    assert match in one_line(e)
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("changes,match", [({"head_dim": 16}, "head_dim"), ({"attention_bias": True}, "bias"),
                                           ({"local_window_size": 0}, "window")])
def test_faolmo_configs_the_format_does_not_define_are_refused(tmp_path, changes, match):
    folder, _ = write_faolmo(tmp_path / "fa", **changes)
    with pytest.raises(ConfigError) as e:
        load_pretrained(folder)
    assert match in one_line(e)


def test_a_q_proj_without_router_rows_is_refused(tmp_path):
    folder, t = write_faolmo(tmp_path / "fa")
    t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][: H * D]
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"\[H\*D \+ H, hidden\]"):
        load_pretrained(folder)


# (e) the CLI ---------------------------------------------------------------------------------------------

def test_cli_generate_and_perplexity_take_a_faolmo_folder(tmp_path, capsys):
    folder, _ = write_faolmo(tmp_path / "fa")
    assert main(["generate", "--model", str(folder), "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "mu_f" in captured.out + captured.err  # the routers' share of full attention while decoding
    texts = write_texts(tmp_path / "texts", n=6, words=30)
    assert main(["perplexity", "--model", str(folder), "--data", str(texts), "--seq-len", "16", "--device", "cpu",
                 "--no-progress"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_cli_convert_writes_the_format(olmo2, tmp_path, capsys):
    out = tmp_path / "fa"
    assert main(["convert", "--model", str(olmo2), "--out", str(out), "--mechanism", "aha", "--window", "4",
                 "--format", "faolmo"]) == 0
    assert "faolmo" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "faolmo" and config["local_window_size"] == 4
    assert (out / "tokenizer.json").exists()
    model = load_pretrained(out)
    with torch.no_grad():
        model(ids_for(model.config.vocab_size))
    assert not gates_of(model).any()  # a router without bias starts at zero: every head local until trained


@pytest.mark.parametrize("source,flags,match", [
    ("olmo2", ["--mechanism", "dar", "--d-down", "16"], "AHA routers"), ("olmo2", ["--tau", "0.3"], "tau"),
    ("llama", [], "OLMo-2"), ("faolmo", [], "already converted")])
def test_cli_convert_refusals_are_one_line(olmo2, tmp_path, capfd, source, flags, match):
    model = {"olmo2": lambda: olmo2, "llama": lambda: write_model("Llama-3.2-1B", tmp_path / "llama"),
             "faolmo": lambda: write_faolmo(tmp_path / "in")[0]}[source]()
    capfd.readouterr()
    assert main(["convert", "--model", str(model), "--out", str(tmp_path / "o"), "--window", "4", "--format",
                 "faolmo", *flags]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and match in err[0], err
    assert not (tmp_path / "o").exists()


def test_sft_fine_tunes_the_authors_checkpoint_and_hands_it_back(tmp_path, capfd):
    """allhere sft on a faolmo folder trains its routers as they are (no second conversion), saves in allhere's
    format, and save_pretrained(format="faolmo") writes the authors' format again; another window is refused."""
    from hf_fixtures import write_chat

    folder, _ = write_faolmo(tmp_path / "fa")
    chat = write_chat(tmp_path / "chat.jsonl")
    common = ["sft", "--model", str(folder), "--data", str(chat), "--seq-len", "48", "--batch-size", "2",
              "--global-batch", "2", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "other"), "--window", str(WINDOW + 1), "--max-steps", "1"]) == 2
    assert "already converted" in capfd.readouterr().err
    assert main([*common, "--out", str(tmp_path / "run"), "--window", str(WINDOW), "--max-steps", "2",
                 "--lr", "1e-3"]) == 0
    tuned = load_pretrained(tmp_path / "run" / "model", dtype=torch.float32)
    before = load_pretrained(folder, dtype=torch.float32)
    router = "model.layers.0.self_attn.allhere.router.weight"
    assert not torch.equal(tuned.state_dict()[router], before.state_dict()[router])
    save_pretrained(tuned, tmp_path / "back", format="faolmo")
    again = load_pretrained(tmp_path / "back", dtype=torch.float32)
    ids = ids_for(tuned.config.vocab_size)
    with torch.no_grad():
        assert rel_err(again(ids).logits, tuned(ids).logits) < 1e-2  # saved in bf16, as published
