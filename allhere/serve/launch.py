"""``allhere serve``: vLLM's OpenAI-compatible server on a model folder, with allhere's vLLM plugin (a GGUF file
is served from its de-quantized copy, ``allhere.hf.gguf.as_folder``).

The server is vLLM's own (``vllm serve``), started as a child process in its own session; the plugin
(``allhere.serve.vllm.plugin``, found by vLLM through its ``vllm.general_plugins`` entry point) makes it
load folders written by ``allhere convert`` / ``allhere sft``. This module checks what can be checked
before vLLM spends half a minute starting (the folder, the mechanism, the head size on the CPU, the
port, the limits), warns where the server is reachable from other machines without an API key, waits
(bounded) until vLLM's ``/health`` answers 200, prints its address, relays the routing statistics of AHA
models (vLLM's ``/metrics`` carries them too: ``allhere.serve.vllm.metrics``), and stops the whole process
group on Ctrl-C / SIGTERM.

The API key reaches vLLM in its environment (``VLLM_API_KEY``, which vLLM reads), never on its command line,
where ``ps`` would show it to every user of the machine.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..validation import ConfigError
from . import serving
from .cost import decode_work
from .server_process import (
    KEEP_WORK,
    PARENT_ENV,
    WORK_PREFIX,
    child_command,
    local_context,
    prune_work_folders,
    stop,
    wait_ready,
    why_stopped,
)
from .serving import BACKEND_ENV, SERVE_BACKENDS
from .vllm.metrics import MULTIPROC_ENV
from .vllm.plugin import CPU_HEAD_SIZES, MODELS, RESET_SUFFIX, STATS_ENV, TRANSFORMERS_BACKEND

KEY_ENV = "VLLM_API_KEY"  # vLLM's own: its server requires the key on /v1/... where this is set
MAX_QUEUED = 1024  # requests in flight (computed or waiting) by default: beyond, vLLM answers 503 at once
# vLLM's CPU default reserves 92% of the machine's memory, and refuses to start when less is free
CPU_KV_CACHE_GIB = 4.0
CPU_MAX_NUM_SEQS = 128  # vLLM's own default of requests computed at once by its OpenAI server on the CPU
INSTALL = ("vLLM is not installed in this Python: install allhere's serving extra (docs/serving.md: "
           "scripts/install_serve.sh does it on a fresh machine, CPU or GPU)")


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder} is not a saved model (no config.json in it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


def check_servable(config: dict, folder: str | Path, cpu: bool) -> None:
    """What vLLM or the plugin would refuse after loading, said before: a mechanism not served (on this device, on
    this family: ``allhere.serve.serving``), a family not served, a head size vLLM's CPU attention has no kernel
    for."""
    mech = config.get("allhere_mechanism")
    kind = mech.get("kind") if isinstance(mech, dict) else None
    arch = (config.get("architectures") or [None])[0]
    if mech is not None:
        why = serving.refusal(kind, "cpu" if cpu else "cuda", arch, MODELS.get(arch) == TRANSFORMERS_BACKEND)
        if why is not None:
            raise ConfigError(f"{folder}: {why}")
    if mech is not None and arch not in MODELS:  # vLLM would serve the unconverted model: refuse
        raise ConfigError(f"{folder}: allhere's vLLM plugin does not serve converted {arch} models yet (served: "
                          f"{', '.join(sorted(MODELS))})")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None)
    if cpu and head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"{folder}: head_dim {head_dim} is not supported by vLLM's CPU attention (supported: "
                          f"{', '.join(map(str, CPU_HEAD_SIZES))})")


def served_dtype(dtype: str, config: dict) -> str:
    """The dtype the server runs in: ``dtype``, or for "auto" the one config.json says the weights were saved in
    (transformers' "dtype", formerly "torch_dtype"; float32 where it says none, as transformers loads such a
    folder). Handed to vLLM by name: its own "auto" serves float32 weights in bfloat16 on the CPU."""
    if dtype != "auto":
        return dtype
    saved = config.get("dtype") or config.get("torch_dtype") or "float32"
    saved = str(saved).removeprefix("torch.")
    if saved not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"config.json says the weights are {saved}: give --dtype float32, bfloat16 or float16")
    return saved


def check_backend(backend: str, config: dict, cpu: bool) -> None:
    """ConfigError where ``backend`` cannot serve this model's layers: the Triton paged kernel computes AHA only,
    and off CUDA only under Triton's interpreter."""
    if backend not in SERVE_BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(SERVE_BACKENDS)}, got {backend!r}")
    kind = (config.get("allhere_mechanism") or {}).get("kind")
    if backend == "triton" and kind != "aha":
        raise ConfigError("--backend triton: allhere's Triton paged kernel serves AHA models only, not "
                          f"{kind or 'a plain model'}")
    if backend == "triton" and cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--backend triton needs CUDA (off CUDA it runs only under Triton's interpreter, "
                          "TRITON_INTERPRET=1: slow, for tests)")


def check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        # as the server will (uvicorn): connections of an earlier server in TIME_WAIT do not block the port,
        # another process listening on it does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}): the port is in use or the "
                              "address is not this machine's") from None


def _served_max_len(url: str, key: str | None) -> int | None:
    """The longest prompt + completion the server takes (vLLM's /v1/models says it), None where it does not say."""
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5, context=local_context(url)) as r:
            return int(json.loads(r.read())["data"][0]["max_model_len"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def cut_note(config: dict, max_model_len: int | None, longest: int | None) -> str:
    """What the ready line adds where vLLM's auto-fit made requests shorter than the model's positions."""
    positions = config.get("max_position_embeddings")
    if max_model_len is not None or longest is None or not isinstance(positions, int) or longest >= positions:
        return ""
    return (f" (cut from the model's {positions} positions to what the KV cache holds for one request: "
            "--kv-cache-gib for more)")


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: 127.x.x.x, ::1 or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def exposure_warning(host: str, port: int, key: str | None, tls: bool = False) -> str | None:
    """The warning line for a server other machines may reach without an API key, or with one but without TLS;
    None where there is none."""
    if loopback(host) or (key and tls):
        return None
    if key:
        return (f"allhere serve: warning: listening on {host}:{port} without TLS: the API key and every request and "
                "answer cross the network unencrypted; give --ssl-certfile and --ssl-keyfile, or put a TLS proxy in "
                "front")
    return (f"allhere serve: warning: listening on {host}:{port} without an API key: anyone who can reach this port "
            f"can use the model; set one with {KEY_ENV}=KEY in the environment (or --api-key KEY)")


def check_tls(certfile: str | None, keyfile: str | None) -> bool:
    """Whether the server speaks https; ConfigError for one of the two files without the other, or one that cannot
    be read (vLLM would fail only after loading the model)."""
    if (certfile is None) != (keyfile is None):
        raise ConfigError("--ssl-certfile and --ssl-keyfile go together: give both (the certificate and its private "
                          "key, PEM files) or neither")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if path is not None:
            try:
                with open(path, "rb") as f:
                    head = f.read(4096)
            except OSError as e:
                raise ConfigError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None
            if b"-----BEGIN " not in head:
                raise ConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return certfile is not None


def _rope_scaled(rope) -> bool:
    """Whether a config's rotary settings (one dict, or one per layer type) scale the positions."""
    if not isinstance(rope, dict):
        return False
    if any(isinstance(v, dict) for v in rope.values()):
        return any(_rope_scaled(v) for v in rope.values())
    return rope.get("rope_type", rope.get("type", "default")) != "default" or "factor" in rope


def check_limits(config: dict, max_model_len: int | None, max_num_seqs: int | None, max_queued: int | None,
                 max_num_batched_tokens: int | None = None, cpu: bool = True) -> None:
    """ConfigError for limits vLLM would refuse after its start, or that contradict each other."""
    seqs = max_num_seqs or (CPU_MAX_NUM_SEQS if cpu else None)  # on a GPU vLLM's default follows its memory
    if max_num_batched_tokens is not None and seqs is not None and max_num_batched_tokens < seqs:
        raise ConfigError(f"--max-num-batched-tokens {max_num_batched_tokens} is below the {seqs} requests computed "
                          f"at once ({'--max-num-seqs' if max_num_seqs else 'vLLM default on the CPU'}): each "
                          f"needs a token of the step; give --max-num-seqs {max_num_batched_tokens} or fewer")
    if max_queued is not None and max_num_seqs is not None and max_queued < max_num_seqs:
        raise ConfigError(f"--max-queued {max_queued} is below --max-num-seqs {max_num_seqs}: no more than "
                          f"{max_queued} requests would ever run at once; raise it or lower --max-num-seqs")
    positions = config.get("max_position_embeddings")
    # vLLM's own rule, where it is plain: no rotary scaling stretches the positions, no model_max_length allows more
    if (max_model_len is not None and isinstance(positions, int) and max_model_len > positions
            and not _rope_scaled(config.get("rope_scaling")) and not _rope_scaled(config.get("rope_parameters"))
            and "model_max_length" not in config and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1"):
        raise ConfigError(f"--max-model-len {max_model_len} is longer than the model's {positions} positions "
                          "(max_position_embeddings in config.json)")


def stats_every_from_env() -> float:
    """Seconds between routing lines: $ALLHERE_SERVE_STATS_EVERY, else 30. ConfigError naming the variable and
    its value when it is not a number of seconds (0 or more)."""
    value = os.environ.get("ALLHERE_SERVE_STATS_EVERY", "30")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # NaN included
        raise ConfigError(f"ALLHERE_SERVE_STATS_EVERY={value!r} is not a number of seconds (0 or more) between "
                          "routing lines; set one, or unset it for 30")
    return seconds


def format_stats(stats: dict) -> str:
    """One line of the routing statistics the model wrote (``allhere.serve.vllm.model.routing_stats``)."""
    layers = sorted((int(i), g, n) for i, (g, n) in stats["layers"].items())
    layers = ", ".join(f"{i}: {100 * g / n:.1f}%" for i, g, n in layers if n)
    kv = stats.get("kv")
    return (f"mu_f {100 * stats['mu_f']:.1f}% over {stats['tokens']} tokens (per layer {layers})"
            + (f"; KV cache {kv['per_token']} bytes per token" if kv else ""))


def format_kv(kv: dict) -> str:
    """The caches' bytes (``allhere.serve.vllm.model.kv_bytes``) in one line."""
    # AHA's layers are in the per-token bytes: they keep every key, their window and sinks free no block
    window = (f" + {kv['per_request']} bytes per request (the keys of windows and sinks, DAR's near window "
              "included)") if kv["per_request"] else ""
    return (f"KV cache {kv['per_token']} bytes per token of context{window}; the unconverted model: "
            f"{kv['plain_per_token']} bytes per token")



def serve(model: str, host: str = "127.0.0.1", port: int = 8000, max_model_len: int | None = None,
          dtype: str = "auto", kv_cache_gib: float | None = None, verbose: bool = False, ready_timeout: float = 900.0,
          stats_every: float | None = None, backend: str = "auto", api_key: str | None = None,
          max_num_seqs: int | None = None, max_queued: int | None = None,
          max_num_batched_tokens: int | None = None, ssl_certfile: str | None = None,
          ssl_keyfile: str | None = None) -> None:
    """Start vLLM's OpenAI-compatible server on ``model``; run until a signal (the CLI turns SIGINT / SIGTERM
    into exceptions, and the server is stopped on the way out). Raises ConfigError for what is wrong before
    or while it starts, or when vLLM stops by itself. ``stats_every``: seconds between routing lines
    (default: $ALLHERE_SERVE_STATS_EVERY, else 30). ``kv_cache_gib``: memory for the KV cache (default: 4 GiB
    on the CPU, vLLM's share of the GPU's memory on a GPU). ``backend``: the path of the layers allhere computes
    (op family "paged": ``allhere.ops.paged.dispatch``). ``api_key``: required of clients on /v1/... (default:
    $VLLM_API_KEY, else none). ``max_model_len`` (default: vLLM's auto-fit, the model's own maximum lowered to
    what the KV cache holds), ``max_num_seqs`` (requests computed at once; default vLLM's), ``max_queued``
    (requests in flight, beyond which vLLM answers 503; default ``MAX_QUEUED``, or ``max_num_seqs`` where that is
    more), ``max_num_batched_tokens`` (tokens computed in one step, prefill chunks included; default vLLM's, 2048 on
    the CPU). ``ssl_certfile`` and ``ssl_keyfile``: PEM files of a certificate and its key, both or neither; with
    them the server speaks https (handed to vLLM's server). ``ready_timeout``: seconds to wait for /health."""
    import torch

    if stats_every is None:
        stats_every = stats_every_from_env()
    if api_key == "":
        raise ConfigError("--api-key is empty")
    key = api_key or os.environ.get(KEY_ENV) or None
    name = Path(model).resolve().name  # what requests name as "model"
    cpu = not torch.cuda.is_available()
    if Path(model).is_file():  # a GGUF (a folder is read as it is: allhere.hf is not imported for it)
        from ..hf.gguf import as_folder
        from ..hf.gguf import read_config as gguf_config

        check_servable(gguf_config(model).to_dict(), model, cpu)  # ConfigError for a file that is no GGUF
        check_port(host, port)
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(INSTALL)
        # vLLM reads allhere's plugin models from folders: serve the GGUF's de-quantized copy
        source, model, name = model, str(as_folder(model)), Path(model).stem
        print(f"allhere serve: {source} is a GGUF file: serving its de-quantized copy (float32 safetensors, written "
              f"once, reused while the file is unchanged): {model}", flush=True)
    config = read_config(model)
    check_servable(config, model, cpu)
    check_backend(backend, config, cpu)
    check_limits(config, max_model_len, max_num_seqs, max_queued, max_num_batched_tokens, cpu=cpu)
    tls = check_tls(ssl_certfile, ssl_keyfile)
    if max_queued is None:
        max_queued = max(MAX_QUEUED, max_num_seqs or 0)
    dtype = served_dtype(dtype, config)
    check_port(host, port)
    warning = exposure_warning(host, port, key, tls)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL) from None
    from ..runtime.runlock import run_lock

    prune_work_folders(keep=KEEP_WORK - 1)  # the older servers' folders, beyond the last ones (never a running one's)
    work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
    held = run_lock(work)  # while this server runs: another serve's pruning leaves its folder alone
    held.__enter__()
    log, stats_file, metrics = work / "vllm.log", work / "routing.json", work / "prometheus"
    metrics.mkdir()  # new for each server: the API server's /metrics reads every process's files there
    cmd = [*child_command(), "--model", str(model), "--host", host, "--port", str(port), "--dtype", dtype,
           "--served-model-name", name, "--max-model-len", str(max_model_len or "auto")]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    cmd += ["--max-num-queued-reqs", str(max_queued)]
    if tls:
        cmd += ["--ssl-certfile", str(Path(ssl_certfile).resolve()), "--ssl-keyfile", str(Path(ssl_keyfile).resolve())]
    spec = serving.spec((config.get("allhere_mechanism") or {}).get("kind"))
    if not cpu and spec is not None and not spec.cuda_graphs:
        cmd += ["--enforce-eager"]  # e.g. AHA's Triton paged kernel: its grid follows each step's lengths
    if kv_cache_gib is None and cpu:
        kv_cache_gib = CPU_KV_CACHE_GIB
    if kv_cache_gib is not None:
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    env = {**os.environ, STATS_ENV: str(stats_file), BACKEND_ENV: backend, "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", PARENT_ENV: str(os.getpid()), MULTIPROC_ENV: str(metrics)}
    if key:
        env[KEY_ENV] = key
    out = None if verbose else open(log, "w")
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except BaseException:
        held.__exit__(None, None, None)
        raise
    scheme = "https" if tls else "http"
    url = f"{scheme}://{host if ':' not in host else f'[{host}]'}:{port}"
    # this machine reaches a server listening on every address through the loopback one
    local = {"0.0.0.0": f"{scheme}://127.0.0.1", "::": f"{scheme}://[::1]"}.get(host, url.rsplit(":", 1)[0])
    local += f":{port}"
    try:
        took = wait_ready(proc, local, ready_timeout, None if verbose else log)
        reset = Path(str(stats_file) + RESET_SUFFIX)
        reset.touch()  # vLLM's warm-up passes are not counted: the counts start again at the next forward
        longest = _served_max_len(local, key)
        print(f"allhere serve: {model} at {url}/v1 (OpenAI-compatible: /v1/models, /v1/completions, "
              f"/v1/chat/completions; /health, /metrics) as model \"{name}\" in {dtype}"
              + (f", up to {longest} tokens per request" if longest else "")
              + cut_note(config, max_model_len, longest)
              + (", API key required" if key else "")
              + f"; started in {took:.0f} s; Ctrl-C stops it", flush=True)
        if not verbose:
            print(f"allhere serve: vLLM's log: {log}", flush=True)
        stats = _read_stats(stats_file)
        if stats and stats.get("kv"):  # written by the model as it was built (a converted folder)
            print(f"allhere serve: {format_kv(stats['kv'])}", flush=True)
        work = decode_work(config, longest or config.get("max_position_embeddings") or 0)
        if work is not None:
            print(f"allhere serve: {work.line()}", flush=True)
        shown, shown_at = None, 0.0
        while proc.poll() is None:  # until a signal (raised here by the CLI's handlers) or vLLM's own end
            time.sleep(1.0)
            stats = None if reset.exists() else _read_stats(stats_file)  # until then, the warm-up's
            if (stats and stats.get("mu_f") is not None and stats != shown
                    and time.monotonic() - shown_at >= stats_every):
                print(f"allhere serve: {format_stats(stats)}", flush=True)
                shown, shown_at = stats, time.monotonic()
        raise ConfigError(f"vLLM stopped (exit code {proc.returncode}): {why_stopped(None if verbose else log)}")
    finally:
        stop(proc)
        if out is not None:
            out.close()
        shutil.rmtree(metrics, ignore_errors=True)
        held.__exit__(None, None, None)


def _read_stats(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
