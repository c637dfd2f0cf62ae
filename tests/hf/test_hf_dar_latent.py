"""``dar_latent`` on Hugging Face models converted by ``allhere.hf.convert``, offline (tiny random configs of
test_hf, plus Llama-3's scaled RoPE): initialised from the host at full rank it is the original model; its cache
(the window's K/V, a latent + rotated key per token, inside transformers' Cache API) decodes as the full forward
computes, chunked prefill and greedy generation included."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhere import AHAConfig, DARLatentConfig  # noqa: E402
from allhere.hf import convert, new_cache  # noqa: E402
from allhere.hf.cache import DARCacheLayer, cache_kwargs  # noqa: E402
from allhere.hf.convert import dims_of  # noqa: E402
from allhere.mechanisms.dar_latent_init import init_from_host  # noqa: E402

from helpers import rel_err  # noqa: E402
from test_hf import COMMON, build, family_config  # noqa: E402

HD, KV = 16, 2  # head_dim and KV heads of test_hf's configs
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # short: the scaling changes most of a 16-channel head's frequencies


def llama3(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_key_value_heads=KV, rope_theta=500000.0, rope_scaling=LLAMA3, **COMMON)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def model_of(name):
    return llama3() if name == "llama3" else build(name)


def sharpen(model):
    """Peaked attention (q, k scaled up from the random init), as trained models have."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


@pytest.mark.parametrize("name", ["llama", "llama3", "mistral", "qwen3", "olmo2"])  # scaled RoPE; q/k norms
def test_full_rank_from_the_host_is_the_original(name):
    """Every pair kept and d_c = rank of W_V, initialised from the host (calibrated on the ids): the original
    logits (k norms included: the kept channels are the host's keys as they are); fewer pairs, with the content
    rank still full, change them."""
    ids = torch.randint(3, 97, (2, 24))
    hd = dims_of(model_of(name).config).head_dim  # Qwen3's is 128: W_V's rank is then d = 64
    with torch.no_grad():
        want = sharpen(model_of(name))(ids).logits
        full = convert(sharpen(model_of(name)), DARLatentConfig(window=4, d_down=min(KV * hd, 64), rope_pairs=hd // 2))
        init_from_host(full, lambda: full(ids))
        assert rel_err(full(ids).logits, want) < 1e-5
        if name in ("llama", "llama3"):
            partial = convert(sharpen(model_of(name)), DARLatentConfig(window=4, d_down=64, rope_pairs=2))
            init_from_host(partial)
            assert rel_err(partial(ids).logits, want) > 1e-3


@pytest.mark.parametrize("window", [0, 3, 30])
def test_chunked_prefill_and_decoding_equal_the_full_forward(window):
    model = convert(sharpen(llama3()), DARLatentConfig(window=window, d_down=12, rope_pairs=2))
    init_from_host(model)
    ids = torch.randint(3, 97, (2, 26))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = new_cache(model)
        parts = [model(ids[:, a:b], **cache_kwargs(cache), use_cache=True).logits for a, b in ((0, 11), (11, 20))]
        parts += [model(ids[:, t:t + 1], **cache_kwargs(cache), use_cache=True).logits for t in range(20, 26)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-5
    layer = cache.layers[0]
    assert isinstance(layer, DARCacheLayer) and layer.latent.shape == (2, 26, 12 + 2 * 2 * KV)
    assert layer.keys.shape[2] == min(window, 26)


def test_queries_unrotate_with_the_hosts_scaled_table():
    """The content part of a query is the host's rotated query with Llama-3's scaled rotation undone: what the
    query was before the rotary embedding, at every position."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from allhere.mechanisms.dar_latent_channels import unrotate

    model = llama3()
    q = torch.randn(2, 4, 24, HD)
    cos, sin = model.model.rotary_emb(q, torch.arange(24)[None].expand(2, 24))
    rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert rel_err(rotated, q) > 0.1 and rel_err(unrotate(rotated, cos, sin), q) < 1e-6


GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=2)


@pytest.mark.parametrize("name", ["llama", "llama3"])
def test_cached_greedy_generation_equals_uncached(name):
    model = convert(sharpen(model_of(name)), DARLatentConfig(window=3, d_down=12, rope_pairs=2))
    init_from_host(model)
    prompt = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        uncached = model.generate(prompt, use_cache=False, **GREEDY)
        out = model.generate(prompt, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, uncached)
    assert all(isinstance(layer, DARCacheLayer) for layer in out.past_key_values.layers)


def test_left_padded_batch_with_the_cache_equals_each_prompt_alone():
    model = convert(sharpen(build("llama")), DARLatentConfig(window=3, d_down=12, rope_pairs=2))
    init_from_host(model)
    short, long = torch.randint(3, 97, (1, 5)), torch.randint(3, 97, (1, 9))
    batch = torch.cat([torch.cat([torch.full((1, 4), 2), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    with torch.no_grad():
        both = model.generate(batch, attention_mask=mask, **GREEDY)[:, 9:]
        alone = [model.generate(p, **GREEDY)[:, p.shape[1]:] for p in (short, long)]
    assert torch.equal(both[0], alone[0][0]) and torch.equal(both[1], alone[1][0])


def test_hosts_without_plain_kv_projections_are_refused():
    from allhere import ConfigError

    cfg = DARLatentConfig(window=3, d_down=12, rope_pairs=2)
    host = build("qwen2")  # q/k/v biases
    with pytest.raises(ConfigError, match="layer 0: .*this layer's k_proj is biased; convert with host_init=False"):
        convert(host, cfg)
    assert not any(".allhere." in k for k in host.state_dict())  # refused before anything changed
    model = convert(host, cfg, host_init=False)  # fresh weights, for training from scratch
    with pytest.raises(ConfigError, match="k_proj / v_proj without bias; this layer's k_proj is biased"):
        init_from_host(model)
    assert family_config("qwen2").num_key_value_heads == KV


def test_convert_initialises_from_the_host():
    """``convert`` alone sets the latent from the host: with calibration ids at full rank it is the original
    model; at reduced rank (d_c 32 of the 56-rank [W_K content ; W_V], 2 of 8 pairs) it differs, but its logits
    are far nearer the original's than those of the fresh initialisation (``host_init=False``: about 0.1 against
    0.55 relative error), and calibration picks other pairs than the data-free choice."""
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = sharpen(build("llama"))(ids).logits
        full = convert(sharpen(build("llama")), DARLatentConfig(window=4, d_down=KV * HD, rope_pairs=HD // 2),
                       calibration=ids)
        assert rel_err(full(ids).logits, want) < 1e-5
        want = build("llama")(ids).logits
        small = DARLatentConfig(window=4, d_down=32, rope_pairs=2)
        errs = {}
        for name, kwargs in (("calibrated", {"calibration": ids}), ("data-free", {}), ("fresh", {"host_init": False})):
            model = convert(build("llama"), small, seed=0, **kwargs)
            errs[name] = rel_err(model(ids).logits, want)
            channels = model.model.layers[0].self_attn.allhere.channels
            if name != "fresh":
                errs[name + " channels"] = channels.clone()
    assert 1e-3 < errs["calibrated"] < errs["fresh"] / 3 and errs["data-free"] < errs["fresh"] / 3, errs
    assert not torch.equal(errs["calibrated channels"], errs["data-free channels"])


def test_the_meta_device_and_a_sharded_load_are_refused_in_one_line():
    from allhere import ConfigError
    from allhere.hf.io import meta_model
    from allhere.hf.sharded_load import _converted_meta_model

    cfg = DARLatentConfig(window=4, d_down=16, rope_pairs=2)
    with pytest.raises(ConfigError, match="on the meta device .*host_init=False") as e:
        convert(meta_model(family_config("llama")), cfg)
    assert "\n" not in str(e.value)
    meta = convert(meta_model(family_config("llama")), cfg, host_init=False)
    assert meta.model.layers[0].self_attn.allhere.down.weight.is_meta
    with pytest.raises(ConfigError, match="no rank holds whole in a sharded load: convert on one process first"):
        _converted_meta_model(family_config("llama"), cfg, "full", torch.float32, fresh=False)
    _converted_meta_model(family_config("llama"), cfg, "full", torch.float32, fresh=True)  # assemble(): a state dict
    with pytest.raises(ValueError, match="calibration is for mechanisms initialised from the host"):
        convert(build("llama"), AHAConfig(window=4), calibration=torch.zeros(1, 4, dtype=torch.long))


def test_save_then_load_keeps_the_latent_weights_and_the_kept_channels(tmp_path):
    from allhere.hf import load_pretrained, save_pretrained

    base = build("llama")
    ids = torch.randint(3, 97, (2, 20))
    model = convert(sharpen(base), DARLatentConfig(window=3, d_down=12, rope_pairs=2))
    init_from_host(model, lambda: model(ids, use_cache=False))
    save_pretrained(model, tmp_path / "m")
    again = load_pretrained(tmp_path / "m").eval()
    first = again.model.layers[0].self_attn.allhere
    assert torch.equal(first.channels, model.model.layers[0].self_attn.allhere.channels)
    assert not torch.equal(first.channels, type(first)(first.cfg, first.dims).channels)  # calibrated, not the default
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_allhere_convert_gives_the_host_initialised_model(tmp_path):
    """``allhere convert --mechanism dar_latent --rope-pairs r`` saves the model ``convert`` gives from the host
    without calibration text (pairs by the weights' score, then the SVD); --rope-pairs on another mechanism is
    refused."""
    from allhere.cli import main
    from allhere.hf import load_pretrained
    from allhere.hf.io import load_local

    from hf_fixtures import write_model

    folder = write_model("SmolLM2-135M", tmp_path / "m", init_std=0.1)
    assert main(["convert", "--model", str(folder), "--out", str(tmp_path / "o"), "--mechanism", "dar_latent",
                 "--window", "4", "--d-down", "18", "--rope-pairs", "3"]) == 0
    saved = load_pretrained(tmp_path / "o")
    want = convert(load_local(folder)[1], DARLatentConfig(window=4, d_down=18, rope_pairs=3))
    got, ref = (m.model.layers[1].self_attn.allhere for m in (saved, want))
    assert got.cfg.rope_pairs == 3
    assert rel_err(got.up_v.weight, ref.up_v.weight) < 1e-6 and torch.equal(got.channels, ref.channels)
    assert main(["convert", "--model", str(folder), "--out", str(tmp_path / "a"), "--window", "4",
                 "--rope-pairs", "3"]) == 2  # not a setting of AHA: refused, nothing written
    assert not (tmp_path / "a").exists()


def test_allhere_convert_with_calibration_text(tmp_path, capsys):
    """``allhere convert --mechanism dar_latent --calibration TEXT`` saves the model ``convert`` gives with the
    file's tokens as calibration (pairs by the host's |q||k| on them); a file that is not UTF-8 or not text, too
    short a text, or another mechanism: one line, exit 2, nothing written."""
    from allhere.cli import main
    from allhere.hf import load_pretrained
    from allhere.hf.calibration import calibration_ids
    from allhere.hf.io import load_local

    from hf_fixtures import write_model

    folder = write_model("SmolLM2-135M", tmp_path / "m", init_std=0.1)
    text = tmp_path / "calib.txt"
    lines = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"
    text.write_text(lines * 3, encoding="utf-8")
    flags = ["--mechanism", "dar_latent", "--window", "4", "--d-down", "18", "--rope-pairs", "3"]
    for name, calib in (("plain", []), ("calibrated", ["--calibration", str(text)])):
        assert main(["convert", "--model", str(folder), "--out", str(tmp_path / name), *flags, *calib]) == 0
    tokenizer, host = load_local(folder)
    ids = calibration_ids(tokenizer, text.read_text(encoding="utf-8"))
    assert ids.shape[0] == 1 and 16 <= ids.shape[1] < 512  # shorter than a window: one window of all of it
    assert calibration_ids(tokenizer, lines * 1000).shape == (8, 512)  # a long text: its first 8 windows
    want = convert(host, DARLatentConfig(window=4, d_down=18, rope_pairs=3), calibration=ids)
    got, ref, plain = (m.model.layers[1].self_attn.allhere for m in (load_pretrained(tmp_path / "calibrated"), want,
                                                                         load_pretrained(tmp_path / "plain")))
    assert torch.equal(got.channels, ref.channels) and rel_err(got.up_v.weight, ref.up_v.weight) < 1e-6
    assert not torch.equal(got.channels, plain.channels)  # chosen on the text, not evenly spaced
    capsys.readouterr()
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00 not text" * 10)
    (tmp_path / "short.txt").write_text("x = 1", encoding="utf-8")
    (tmp_path / "nul.txt").write_bytes(b"valid UTF-8 \x00 but not text\n" * 10)
    for i, (calib, mech, message) in enumerate([("binary.txt", "dar_latent", "not UTF-8 text"),
                                                ("nul.txt", "dar_latent", "it holds NUL bytes"),
                                                ("short.txt", "dar_latent", "at least 16 are needed"),
                                                ("calib.txt", "dar", "--mechanism dar takes no calibration text")]):
        argv = ["convert", "--model", str(folder), "--out", str(tmp_path / f"bad{i}"), *flags,
                "--calibration", str(tmp_path / calib)]
        argv[argv.index("dar_latent")] = mech
        if mech == "dar":
            argv.remove("--rope-pairs"), argv.remove("3")
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / f"bad{i}").exists()
