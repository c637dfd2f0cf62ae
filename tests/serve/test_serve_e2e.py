"""``allhere serve`` end to end: vLLM's OpenAI-compatible server on an AHA model converted by allhere, driven
by the ``openai`` client on 127.0.0.1 -- models, a completion, a chat completion, a streamed completion, 24
concurrent requests (8 computed at once), each answer equal to allhere's own greedy generation; an API key
(401 without it, never on a command line or in the log); malformed requests (4xx), 8 clients that drop their
streams and a request beyond the 24 in flight (503), the server serving on with the greedy answers; the routing
line and the same numbers on vLLM's /metrics; and a SIGTERM that leaves no process behind. One server for all
of them; then a second one over TLS (https only). Skipped where vLLM is not installed (scripts/install_serve.sh)."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

import allhere as ah  # noqa: E402
from allhere.data.chat import ensure_chat_template  # noqa: E402
from allhere.generation import generate, load  # noqa: E402

from hf_fixtures import write_model  # noqa: E402
from test_serve_vllm import SIZES, WINDOW, _convert  # noqa: E402

pytestmark = pytest.mark.slow
NEW = 16
KEY = "e2e-Key_0123456789"
PROMPTS = [f"w{i} w{i + 1} w{i + 2} def __init__(self):" for i in range(24)]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_server(folder: Path, extra: list[str]):
    """``allhere serve`` on ``folder`` (float32, 512 tokens, 1 GiB of KV cache, ``extra`` flags) on a free port of
    127.0.0.1, once it says it is ready: (process, its stdout lines, stderr lines, port, the ready line)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ALLHERE_SERVE_STATS_EVERY"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "allhere.cli", "serve", "--model", str(folder), "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "512", "--kv-cache-gib", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    errors: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    start = time.monotonic()
    while not any("/v1 (OpenAI-compatible" in line for line in lines):
        assert proc.poll() is None, "".join(lines + errors)
        assert time.monotonic() - start < 600, "".join(lines + errors)
        time.sleep(0.5)
    return proc, lines, errors, port, next(line for line in lines if "/v1 (OpenAI-compatible" in line)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_e2e")
    plain = write_model("Llama-3.2-1B", root / "plain", **SIZES)
    folder = _convert(plain, root / "aha-llama", ah.AHAConfig(window=WINDOW, router_init="neutral"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    ensure_chat_template(tokenizer)  # the tiny tokenizer has none: allhere's fallback template
    tokenizer.save_pretrained(str(folder))
    proc, lines, errors, port, ready = start_server(folder, ["--max-num-seqs", "8", "--max-queued", "24",
                                                             "--max-num-batched-tokens", "256", "--api-key", KEY])
    assert f'as model "{folder.name}" in float32, up to 512 tokens per request, API key required' in ready, ready
    assert not errors, "".join(errors)  # no warning: this machine only
    time.sleep(2)  # routing lines come every second here: none before a request (vLLM's warm-up is not counted)
    assert not any("mu_f" in line for line in lines), "".join(lines)
    model, tok = load(str(folder))
    info = {"proc": proc, "lines": lines, "errors": errors, "folder": folder, "name": folder.name, "model": model,
            "tokenizer": tok, "url": f"http://127.0.0.1:{port}", "port": port,
            "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)}
    yield info
    if proc.poll() is None:
        proc.kill()


def ours(server, prompt_ids: list[int]) -> str:
    ids = generate(server["model"], server["tokenizer"], prompt_ids, max_new_tokens=NEW).ids
    return server["tokenizer"].decode(ids)


def complete(server, prompt: str, **kw):
    return server["client"].completions.create(model=server["name"], prompt=prompt, max_tokens=NEW,
                                               temperature=0, **kw)


def test_models_completion_chat_and_stream(server):
    assert [m.id for m in server["client"].models.list().data] == [server["name"]]
    tok = server["tokenizer"]
    text = complete(server, PROMPTS[0]).choices[0].text
    assert text == ours(server, tok.encode(PROMPTS[0]))
    streamed = "".join(chunk.choices[0].text for chunk in complete(server, PROMPTS[0], stream=True))
    assert streamed == text
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    reply = server["client"].chat.completions.create(model=server["name"], messages=messages, max_tokens=NEW,
                                                     temperature=0)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert reply.choices[0].message.content == ours(server, ids)


def test_twenty_four_concurrent_requests(server):
    with ThreadPoolExecutor(24) as pool:  # all in flight at once (--max-queued), 8 computed at a time
        texts = list(pool.map(lambda p: complete(server, p).choices[0].text, PROMPTS))
    assert texts == [ours(server, server["tokenizer"].encode(p)) for p in PROMPTS]


def post(server, body: bytes | dict, key: str | None = KEY, path: str = "/v1/completions") -> tuple[int, str]:
    """Status and body of a POST with a real HTTP client (urllib), whatever the status."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(server["url"] + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def log_of(lines: list[str]) -> str:
    """vLLM's log file, as allhere serve names it."""
    return next(line for line in lines if "vLLM's log:" in line).split("vLLM's log: ")[1].strip()


def scrape(server) -> dict[str, float]:
    """vLLM's /metrics over HTTP: each sample's name with its labels (as Prometheus writes them) -> value."""
    with urllib.request.urlopen(server["url"] + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_the_key_is_required_and_never_shown(server):
    body = {"model": server["name"], "prompt": PROMPTS[0], "max_tokens": 2}
    assert post(server, body, key=None)[0] == 401
    assert post(server, body, key=KEY[:-1])[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    assert post(server, body)[0] == 200
    with urllib.request.urlopen(server["url"] + "/health", timeout=10) as r:  # open: for probes
        assert r.status == 200
    assert KEY not in Path(log_of(server["lines"])).read_text(errors="replace")
    assert not any(KEY in line for line in server["lines"] + server["errors"])
    below = descendants(server["proc"].pid)  # vLLM's processes: the key in their environment, not on a command line
    assert below
    for pid in below:
        try:
            assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            pass


def test_malformed_requests_get_4xx_and_the_server_serves_on(server):
    good = {"model": server["name"], "prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0}
    for body, code in ((b"{not json", 400), ({**good, "model": "no-such-model"}, 404),
                       ({**good, "prompt": "w1 " * 600}, 400),  # longer than --max-model-len 512
                       ({**good, "max_tokens": -1}, 400), ({**good, "max_tokens": 600}, 400)):
        status, text = post(server, body)
        assert status == code, (body if isinstance(body, bytes) else {**body, "prompt": body["prompt"][:20]}, text)
    status, text = post(server, good)
    assert status == 200 and json.loads(text)["choices"][0]["text"] == ours(server, server["tokenizer"].encode(
        PROMPTS[1]))


def quiet(server) -> dict[str, float]:
    """/metrics once nothing runs and allhere's token count stands still."""
    last, start = None, time.monotonic()
    while True:
        metrics = scrape(server)
        running = sum(v for k, v in metrics.items() if k.startswith("vllm:num_requests_running"))
        if running == 0 and last is not None and metrics["allhere_routed_tokens"] == last["allhere_routed_tokens"]:
            return metrics
        assert time.monotonic() - start < 30, metrics
        last = metrics
        time.sleep(0.5)


def open_streams(server, prompts: list[str], tokens: int = 400) -> list[http.client.HTTPConnection]:
    """One streamed request of ``tokens`` tokens per prompt, sent and left unread."""
    streams = []
    for prompt in prompts:
        connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
        body = {"model": server["name"], "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                "temperature": 0}
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        streams.append(connection)
    return streams


def drop(streams: list[http.client.HTTPConnection]) -> None:
    for connection in streams:
        connection.sock.close()
        connection.close()


def test_a_dropped_stream_leaves_the_server_serving(server):
    before = quiet(server)["allhere_routed_tokens"]
    streams = open_streams(server, PROMPTS[:8])  # 8 streams at once, each dropped after its first of 400 tokens
    for connection in streams:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    drop(streams)
    # vLLM aborted them: nothing runs, and far fewer than 8 x 400 tokens went through the model (allhere's count)
    assert quiet(server)["allhere_routed_tokens"] - before < 8 * 400 / 2
    for prompt in PROMPTS[:8]:
        assert complete(server, prompt).choices[0].text == ours(server, server["tokenizer"].encode(prompt))


def in_flight(server) -> float:
    metrics = scrape(server)
    kinds = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(v for k, v in metrics.items() if k.startswith(kinds))


def test_beyond_the_requests_in_flight_503(server):
    quiet(server)
    streams = open_streams(server, PROMPTS)  # 24 requests of 400 tokens in flight: 8 computed, 16 waiting
    try:
        start = time.monotonic()
        while in_flight(server) < len(PROMPTS):
            assert time.monotonic() - start < 30, scrape(server)
            time.sleep(0.1)
        status, text = post(server, {"model": server["name"], "prompt": PROMPTS[3], "max_tokens": NEW,
                                     "temperature": 0})
        assert status == 503, (status, text)
    finally:
        drop(streams)
    quiet(server)
    assert complete(server, PROMPTS[3]).choices[0].text == ours(server, server["tokenizer"].encode(PROMPTS[3]))


LINE = re.compile(r"allhere serve: mu_f ([0-9.]+)% over (\d+) tokens \(per layer (.*)\); "
                  r"KV cache (\d+) bytes per token")


def test_routing_numbers_on_metrics_as_on_the_log_line(server):
    """vLLM's /metrics, read over HTTP, carries allhere's gauges (written by the engine process into the
    Prometheus multiprocess folder allhere serve set up), with the numbers of the last routing line."""
    start = time.monotonic()
    while True:  # the routing line follows the counts within a second or two once requests stop
        metrics = scrape(server)
        logged = [m for line in list(server["lines"]) if (m := LINE.search(line))]
        if logged and metrics.get("allhere_routed_tokens") == float(logged[-1][2]):
            break
        assert time.monotonic() - start < 30, (logged[-1:], {k: v for k, v in metrics.items() if "allhere" in k})
        time.sleep(0.5)
    mu_f, tokens, layers, kv = logged[-1].groups()
    assert metrics["allhere_routed_tokens"] > 0
    assert abs(100 * metrics["allhere_mu_f"] - float(mu_f)) <= 0.05
    per_layer = dict(item.split(": ") for item in layers.split(", "))
    assert len(per_layer) == 2
    for layer, share in per_layer.items():
        assert abs(100 * metrics[f'allhere_layer_mu_f{{layer="{layer}"}}'] - float(share.rstrip("%"))) <= 0.05
    assert metrics["allhere_kv_cache_bytes_per_token"] == float(kv)
    assert metrics['allhere_mechanism_info{mechanism="aha"}'] == 1
    assert any(name.startswith("vllm:") for name in metrics)  # vLLM's own metrics are still there


def test_metrics_of_each_kind_through_the_multiprocess_folder(tmp_path):
    """The gauges as the engine writes them and an API server's registry reads them (a fresh process, as prometheus
    multiprocess mode is chosen at import): a mechanism without routing (DAR) exports its KV bytes and no mu_f;
    AHA's layers without tokens yet read NaN."""
    script = """
import math
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from allhere.serve.vllm.metrics import metrics
kv = {"per_token": 96, "per_request": 4096, "plain_per_token": 512}
metrics("dar", kv, routed=False).publish({"layers": {}, "mu_f": None, "tokens": 0})
aha = metrics("aha", kv, routed=True)
aha.publish({"layers": {0: (1, 4), 1: (0, 0)}, "mu_f": 0.25, "tokens": 2})
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    text = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples['allhere_mechanism_info{mechanism="dar"}'] == samples['allhere_mechanism_info{mechanism="aha"}'] \
        == "1.0"
    assert samples["allhere_kv_cache_bytes_per_request"] == "4096.0"
    assert samples["allhere_kv_cache_unconverted_bytes_per_token"] == "512.0"
    assert samples["allhere_mu_f"] == "0.25" and samples["allhere_routed_tokens"] == "2.0"
    assert samples['allhere_layer_mu_f{layer="0"}'] == "0.25" and samples['allhere_layer_mu_f{layer="1"}'] == "NaN"


def test_routing_line_then_sigterm_leaves_no_process(server):
    proc, lines = server["proc"], server["lines"]
    start = time.monotonic()
    while not any("mu_f" in line for line in lines) and time.monotonic() - start < 30:
        time.sleep(0.5)
    assert any("allhere serve: mu_f" in line for line in lines), "".join(lines)
    kv = [line for line in lines if line.startswith("allhere serve: KV cache ")]
    assert kv and "bytes per token of context" in kv[0], "".join(lines)
    below = descendants(proc.pid)
    assert below  # vLLM's server and engine processes
    log = log_of(lines)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 143  # 128 + SIGTERM, as a shell reports it
    assert not (Path(log).parent / "prometheus").exists()  # the metrics folder goes with the server
    deadline = time.monotonic() + 30
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in below if alive(p)], "".join(lines)


def test_tls_serves_https_only(server, tmp_path):
    """--ssl-certfile / --ssl-keyfile handed to vLLM: the ready line says https, a client that trusts the
    certificate gets the greedy answer over TLS, plain http on the same port gets no answer."""
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                          capture_output=True, text=True) if shutil.which("openssl") else None
    if made is None or made.returncode:
        pytest.skip(f"no openssl to make a certificate with: {made and made.stderr}")
    proc, lines, errors, port, ready = start_server(server["folder"], ["--ssl-certfile", str(cert), "--ssl-keyfile",
                                                                       str(key), "--api-key", KEY])
    try:
        assert f"at https://127.0.0.1:{port}/v1" in ready, ready
        assert not errors, "".join(errors)  # loopback: no warning
        body = json.dumps({"model": server["name"], "prompt": PROMPTS[2], "max_tokens": NEW, "temperature": 0})
        request = urllib.request.Request(f"https://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=60, context=ssl.create_default_context(cafile=str(cert))) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        assert text == ours(server, server["tokenizer"].encode(PROMPTS[2]))
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 143
