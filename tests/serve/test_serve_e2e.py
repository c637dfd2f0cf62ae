"""``allhere serve`` end to end: vLLM's OpenAI-compatible server on an AHA model converted by allhere, driven
by the ``openai`` client on 127.0.0.1 -- models, a completion, a chat completion, a streamed completion, 16
concurrent requests, each answer equal to allhere's own greedy generation, the routing line, and a SIGTERM
that leaves no process behind. Skipped where vLLM is not installed (scripts/install_serve.sh)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
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
PROMPTS = [f"w{i} w{i + 1} w{i + 2} def __init__(self):" for i in range(16)]


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_e2e")
    plain = write_model("Llama-3.2-1B", root / "plain", **SIZES)
    folder = _convert(plain, root / "aha-llama", ah.AHAConfig(window=WINDOW, router_init="neutral"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    ensure_chat_template(tokenizer)  # the tiny tokenizer has none: allhere's fallback template
    tokenizer.save_pretrained(str(folder))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ALLHERE_SERVE_STATS_EVERY"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "allhere.cli", "serve", "--model", str(folder), "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "512", "--kv-cache-gib", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    start = time.monotonic()
    while not any("/v1 (OpenAI-compatible" in line for line in lines):
        assert proc.poll() is None, "".join(lines)
        assert time.monotonic() - start < 600, "".join(lines)
        time.sleep(0.5)
    assert any(f'as model "{folder.name}" in float32' in line for line in lines), "".join(lines)  # requests' name
    time.sleep(2)  # routing lines come every second here: none before a request (vLLM's warm-up is not counted)
    assert not any("mu_f" in line for line in lines), "".join(lines)
    model, tok = load(str(folder))
    info = {"proc": proc, "lines": lines, "folder": folder, "name": folder.name, "model": model, "tokenizer": tok,
            "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)}
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


def test_sixteen_concurrent_requests(server):
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda p: complete(server, p).choices[0].text, PROMPTS))
    assert texts == [ours(server, server["tokenizer"].encode(p)) for p in PROMPTS]


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
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in below if alive(p)], "".join(lines)
