"""``allhere serve`` refuses what would fail after vLLM's half-minute start, before starting it: one line on
stderr, exit code 2. These run without vLLM; the served model itself is tested in test_serve_vllm.py and
test_serve_e2e.py (in the environment of scripts/install_serve.sh, see test_serve_env.py)."""

import importlib.util
import json
import socket

import pytest
import torch

from allhere.cli import main
from allhere.validation import ConfigError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 100}
AHA = {"kind": "aha", "window": 8, "tau": 0.5}


def folder(tmp_path, config) -> str:
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path)


def refused(capfd, *argv) -> str:
    assert main(["serve", *argv]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("allhere serve: error: "), err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("config, says", [
    ("{not json", "cannot be read as JSON"),
    ({**LLAMA, "allhere_mechanism": {"kind": "aamoe", "chunk": 4}}, "mechanism 'aamoe' is not served"),
    ({**LLAMA, "architectures": ["PhiForCausalLM"], "allhere_mechanism": AHA},
     "does not serve converted PhiForCausalLM"),
    ({**LLAMA, "architectures": ["Olmo2ForCausalLM"], "allhere_mechanism": {"kind": "dar", "window": 4, "d_down": 8}},
     "dar is not served on Olmo2ForCausalLM, which vLLM runs through its Transformers backend"),
])
def test_models_the_plugin_cannot_serve(tmp_path, capfd, config, says):
    assert says in refused(capfd, "--model", folder(tmp_path, config), "--port", str(free_port()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention only")
def test_head_size_without_a_cpu_kernel(tmp_path, capfd):
    tiny = {**LLAMA, "hidden_size": 32, "allhere_mechanism": AHA}  # head_dim 16
    err = refused(capfd, "--model", folder(tmp_path, tiny), "--port", str(free_port()))
    assert "head_dim 16 is not supported by vLLM's CPU attention" in err


@pytest.mark.parametrize("mech", [{"kind": "dar", "window": 4, "d_down": 8}, {"kind": "sinks", "window": 4}, AHA,
                                  {"kind": "dar_latent", "window": 4, "d_down": 8, "rope_pairs": 2}],
                         ids=["dar", "sinks", "aha", "dar_latent"])
def test_paged_mechanisms_on_the_cpu_and_aha_on_a_gpu(tmp_path, mech):
    """Sinks, the other masked patterns, DAR and dar_latent run allhere's own torch attention over vLLM's paged cache,
    tested on vLLM's CPU backend only: refused on a GPU rather than served untested. AHA has a GPU path (the
    Triton paged kernel)."""
    from allhere.serve.launch import check_servable
    from allhere.validation import ConfigError

    config = {**LLAMA, "head_dim": 64, "allhere_mechanism": mech}
    check_servable(config, tmp_path, cpu=True)
    if mech["kind"] == "aha":
        check_servable(config, tmp_path, cpu=False)
        return
    with pytest.raises(ConfigError, match=f"{mech['kind']} is served on vLLM's CPU backend only"):
        check_servable(config, tmp_path, cpu=False)


def test_what_is_served_comes_from_the_registry(tmp_path):
    """The checks read each kind's ``Serving`` (declared where it registers): a masked pattern registered outside
    allhere (tests/strided_pattern.py) is served on the CPU and listed, refused on a GPU like the built-in
    patterns, with nothing in allhere.serve naming it; a kind registered without ``serving`` is refused."""
    import strided_pattern  # noqa: F401  (registers "strided_test")

    from allhere.serve import serving
    from allhere.serve.launch import check_servable

    mech = {"kind": "strided_test", "window": 4, "stride": 3}
    assert "strided_test" in serving.kinds("cpu", transformers_backend=True)
    assert serving.kinds("cuda") == ("aha", "sliding")
    for arch in ("LlamaForCausalLM", "Olmo2ForCausalLM"):
        check_servable({**LLAMA, "architectures": [arch], "head_dim": 64, "allhere_mechanism": mech}, tmp_path,
                       cpu=True)
    with pytest.raises(ConfigError, match=r"strided_test is served on vLLM's CPU backend only so far \(served on "
                                          r"CUDA: aha, sliding\)"):
        check_servable({**LLAMA, "head_dim": 64, "allhere_mechanism": mech}, tmp_path, cpu=False)
    with pytest.raises(ConfigError, match="mechanism 'full' is not served .*served: aha, .*strided_test"):
        check_servable({**LLAMA, "head_dim": 64, "allhere_mechanism": {"kind": "full"}}, tmp_path, cpu=True)


def test_port_in_use(tmp_path, capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        err = refused(capfd, "--model", folder(tmp_path, LLAMA), "--port", str(s.getsockname()[1]))
    assert "cannot listen on 127.0.0.1" in err


def test_bad_flags(tmp_path, capfd):
    assert "--port" in refused(capfd, "--model", folder(tmp_path, LLAMA), "--port", "70000")
    assert "--model" in refused(capfd, "--model", str(tmp_path / "missing"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_says_how_to_install(tmp_path, capfd):
    err = refused(capfd, "--model", folder(tmp_path, LLAMA), "--port", str(free_port()))
    assert "vLLM is not installed" in err and "scripts/install_serve.sh" in err


def test_kv_line():
    """The caches' bytes as ``allhere serve`` prints them once the server is ready."""
    from allhere.serve.launch import format_kv, format_stats

    kv = {"per_token": 16384, "per_request": 0, "plain_per_token": 8192}
    assert format_kv(kv) == "KV cache 16384 bytes per token of context; the unconverted model: 8192 bytes per token"
    window = format_kv({"per_token": 0, "per_request": 2 ** 20, "plain_per_token": 8192})
    assert "+ 1048576 bytes per request (the keys of windows and sinks, DAR's near window included)" in window
    line = format_stats({"layers": {"0": [1, 4]}, "mu_f": 0.25, "tokens": 2, "kv": kv})
    assert line == "mu_f 25.0% over 2 tokens (per layer 0: 25.0%); KV cache 16384 bytes per token"


def test_stats_interval_from_the_environment(monkeypatch, tmp_path, capfd):
    """$ALLHERE_SERVE_STATS_EVERY is a number of seconds; anything else is one line naming it, before vLLM."""
    from allhere.serve.launch import stats_every_from_env

    monkeypatch.delenv("ALLHERE_SERVE_STATS_EVERY", raising=False)
    assert stats_every_from_env() == 30
    monkeypatch.setenv("ALLHERE_SERVE_STATS_EVERY", "2.5")
    assert stats_every_from_env() == 2.5
    for bad in ("often", "", "nan", "-1"):
        monkeypatch.setenv("ALLHERE_SERVE_STATS_EVERY", bad)
        with pytest.raises(ConfigError, match=f"^ALLHERE_SERVE_STATS_EVERY={bad!r} is not a number of seconds"):
            stats_every_from_env()
    monkeypatch.setenv("ALLHERE_SERVE_STATS_EVERY", "often")
    err = refused(capfd, "--model", folder(tmp_path, LLAMA), "--port", str(free_port()))
    assert "ALLHERE_SERVE_STATS_EVERY='often' is not a number of seconds" in err and "Traceback" not in err


def test_auto_serves_the_dtype_the_folder_was_saved_in():
    """vLLM's own "auto" would serve float32 weights in bfloat16 on the CPU: allhere hands it the saved dtype."""
    from allhere.serve.launch import served_dtype

    assert served_dtype("auto", {"dtype": "bfloat16"}) == "bfloat16"
    assert served_dtype("auto", {"torch_dtype": "float32"}) == "float32"  # transformers' older name
    assert served_dtype("auto", {}) == "float32"  # as transformers loads a folder that says none
    assert served_dtype("float16", {"dtype": "bfloat16"}) == "float16"
    with pytest.raises(ConfigError, match="float8_e4m3fn: give --dtype"):
        served_dtype("auto", {**LLAMA, "dtype": "float8_e4m3fn"})


def test_backend_checked_before_vllm_starts(monkeypatch):
    """``--backend triton`` serves AHA only, and off CUDA only under Triton's interpreter; the others take any
    served model."""
    from allhere.serve.launch import check_backend

    aha = {**LLAMA, "allhere_mechanism": {"kind": "aha", "window": 64}}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for backend in ("auto", "torch", "reference"):
        check_backend(backend, aha, cpu=True)
    check_backend("triton", aha, cpu=False)
    with pytest.raises(ConfigError, match="needs CUDA"):
        check_backend("triton", aha, cpu=True)
    with pytest.raises(ConfigError, match="AHA models only, not sinks"):
        check_backend("triton", {**LLAMA, "allhere_mechanism": {"kind": "sinks"}}, cpu=False)
    with pytest.raises(ConfigError, match="--backend must be one of"):
        check_backend("flex", aha, cpu=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_backend("triton", aha, cpu=True)


def test_bad_limits_and_keys(tmp_path, capfd):
    """Each a line naming the flag, exit code 2, before vLLM starts; a refused key is never echoed."""
    model = folder(tmp_path, {**LLAMA, "max_position_embeddings": 4096})
    port = str(free_port())
    for flags, says in ((["--max-num-seqs", "0"], "--max-num-seqs"), (["--max-queued", "-3"], "--max-queued"),
                        (["--ready-timeout", "0"], "--ready-timeout"), (["--max-model-len", "0"], "--max-model-len"),
                        (["--max-queued", "4", "--max-num-seqs", "8"], "--max-queued 4 is below --max-num-seqs 8"),
                        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
                        (["--max-num-batched-tokens", "16", "--max-num-seqs", "32"],
                         "--max-num-batched-tokens 16 is below the 32 requests computed at once (--max-num-seqs)"),
                        (["--max-num-batched-tokens", "64"], "--max-num-batched-tokens 64 is below the 128 requests "
                                                             "computed at once (vLLM default on the CPU)"),
                        (["--max-model-len", "5000"], "--max-model-len 5000 is longer than the model's 4096 "
                                                      "positions")):
        assert says in refused(capfd, "--model", model, "--port", port, *flags)
    for key in ("", "two words", "tab\there", "caf\u00e9"):
        err = refused(capfd, "--model", model, "--port", port, "--api-key", key)
        assert "--api-key" in err and (not key or key not in err)


def test_auto_fit_cut_is_said():
    """The ready line says where vLLM's auto-fit served fewer tokens than the model's positions, never otherwise."""
    from allhere.serve.launch import cut_note

    config = {**LLAMA, "max_position_embeddings": 4096}
    assert "cut from the model's 4096 positions" in cut_note(config, None, 1000)
    assert "--kv-cache-gib" in cut_note(config, None, 1000)
    for given, longest in ((None, 4096), (1000, 1000), (None, None)):  # not cut, the user's own length, unknown
        assert cut_note(config, given, longest) == ""


def test_rotary_scaling_leaves_the_length_to_vllm():
    """A scaled rotary table (one, or one per layer type) stretches the positions: vLLM's own check decides."""
    from allhere.serve.launch import check_limits

    base = {**LLAMA, "max_position_embeddings": 4096}
    check_limits({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 16384, None, None)
    check_limits({**base, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                                              "sliding_attention": {"rope_type": "default"}}}, 16384, None, None)
    with pytest.raises(ConfigError, match="longer than the model's 4096 positions"):
        check_limits({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 16384, None, None)
    check_limits(base, 4096, 8, 8)


def test_the_warning_for_a_server_others_can_reach(monkeypatch):
    from allhere.serve.launch import exposure_warning

    for host in ("127.0.0.1", "127.3.0.1", "::1", "localhost"):
        assert exposure_warning(host, 8000, None) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "my-host"):
        line = exposure_warning(host, 8000, None)
        assert line == (f"allhere serve: warning: listening on {host}:8000 without an API key: anyone who can reach "
                        "this port can use the model; set one with VLLM_API_KEY=KEY in the environment (or --api-key "
                        "KEY)")
        assert exposure_warning(host, 8000, "k", tls=True) is None
        assert exposure_warning(host, 8000, "k") == (
            f"allhere serve: warning: listening on {host}:8000 without TLS: the API key and every request and answer "
            "cross the network unencrypted; give --ssl-certfile and --ssl-keyfile, or put a TLS proxy in front")
    assert exposure_warning("127.0.0.1", 8000, "k") is None


def test_tls_files_are_checked_before_anything_starts(tmp_path):
    from allhere.serve.launch import check_tls

    pem, other = tmp_path / "cert.pem", tmp_path / "key.txt"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\n")
    other.write_text("not a key")
    assert check_tls(None, None) is False
    assert check_tls(str(pem), str(pem)) is True
    with pytest.raises(ConfigError, match="--ssl-certfile and --ssl-keyfile go together"):
        check_tls(str(pem), None)
    with pytest.raises(ConfigError, match="--ssl-keyfile .*key.txt: not a PEM file"):
        check_tls(str(pem), str(other))
    with pytest.raises(ConfigError, match="--ssl-certfile .*missing.pem: cannot be read"):
        check_tls(str(tmp_path / "missing.pem"), str(pem))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: it would start")
def test_the_warning_is_printed_before_vllm_starts(tmp_path, capfd, monkeypatch):
    """On 0.0.0.0 without a key: one warning line, then (here, without vLLM) the error; with $VLLM_API_KEY (an empty
    one is no key, as vLLM reads it) a warning that it crosses the network unencrypted; with the key and TLS files no
    warning."""
    model, port = folder(tmp_path, LLAMA), str(free_port())
    pem = tmp_path / "cert.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\n")
    tls = ["--ssl-certfile", str(pem), "--ssl-keyfile", str(pem)]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for key, extra, warned in ((None, [], "without an API key"), ("", [], "without an API key"),
                               ("s3cret", [], "without TLS"), ("s3cret", tls, None)):
        if key is not None:
            monkeypatch.setenv("VLLM_API_KEY", key)
        assert main(["serve", "--model", model, "--host", "0.0.0.0", "--port", port, *extra]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert err[-1].startswith("allhere serve: error: vLLM is not installed")
        assert len(err) == (2 if warned else 1), err
        assert not warned or err[0].startswith(f"allhere serve: warning: listening on 0.0.0.0:{port} {warned}")
