"""Serving throughput under vLLM: the plain model served by vLLM's own attention against the same model converted
by allhere to each mechanism, each behind ``allhere serve`` (vLLM's OpenAI-compatible server with allhere's
plugin), one server after the other, in one run and one table.

    .venv-serve/bin/python benchmarks/serve_throughput.py                       # every mechanism, 2k and 8k prompts
    .venv-serve/bin/python benchmarks/serve_throughput.py --mechanisms aha sinks --prompts 8192
    .venv-serve/bin/python benchmarks/serve_throughput.py --quick               # prompts of 256, 16 new tokens
    .venv-serve/bin/python benchmarks/serve_throughput.py --real runs/smollm2/aha --prompts 8000 --new 64
    .venv-serve/bin/python benchmarks/serve_throughput.py --real runs/smollm2/dar \
        runs/smollm2/dar/latent-w128-d144-r4/stage2/model --prompts 8000 --new 64

``--real RUN [MODEL]``: instead of the random model, a finished real-model job (``allhere demo --model smollm2``):
its control (``RUN/control/model``, full attention, fine-tuned) served by vLLM's own attention against its fine-tuned
AHA model (``RUN/aha/model``, the routers it learned) or the converted folder MODEL (the DAR job's dar_latent),
both in the dtype they were saved in (bfloat16; ``--dtype`` to override), with SmolLM2's grouped-query attention;
every prompt a different stretch of the standard library's held-out files in the model's tokens, sent as token ids.

(needs the serving environment: bash scripts/install_serve.sh). Model: a random-weight Llama of 4 layers, d = 256,
4 heads of 64 (fp32) and a word-level tokenizer of 1024 words, saved with transformers (``--shape``: other
shapes, ``SHAPES``: SmolLM2-135M's, a 4-head GQA model, an MHA model of heads of 128). Its versions: AHA (w = 256,
routers set as ``allhere bench``'s whole-model table sets them: one head global for 27% of the tokens in three
layers, every other head for 2%: mu_f about 7%, measured on a prompt and while serving, both printed), a sliding
window of 256 (vLLM's own sliding-window layers), attention sinks (252 + 4), a per-head dilated window (128 keys
at strides 1, 2, 3, 4), Longformer (window 256, the first 4 tokens global), BigBird (blocks of 64: 3 window
blocks, 1 global, 1 random), DAR (w = 256, d_down = 64; the shape's) and dar_latent (w = 256, d_c = d_down, 4
rotary pairs per kv head, initialised from the random model's weights as ``allhere convert`` does).

Workload, per prompt length (--prompts): every request its own prompt of random words (vLLM's prefix cache never
hits), --new greedy tokens (ignore_eos), streamed; batch 1: --rounds requests one after another; batch 16: 16
concurrent requests, --rounds16 times. Columns: time to first token (TTFT, median over requests); decode tokens/s
(batch x new tokens after the first / time from first to last token, summed over the requests: the rate a
request's tokens come at, times the batch; at batch 16 the steps also carry other requests' prefill chunks, as
vLLM schedules them); all decoding (batch 16 only): tokens/s from the last request's first token to the first
request's last, the steps where all 16 decode and none prefills (n/a when --new is too short for such steps;
vLLM's per-chunk usage counts the tokens); output tokens/s (every new token over the batch's wall time); KV bytes
per token of context (vLLM's kv_cache_usage_perc, polled during the batch-1 requests, at its highest, times the
cache's bytes, over prompt + new tokens). Ratios are against the plain model in the same run. The load average is
printed before and after each server: the machine may be shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

VOCAB = 1024
LAYERS, HIDDEN, HEADS = 4, 256, 4
# --shape: (layers, hidden size, heads, kv heads, MLP width, DAR's d_down); every head 64 wide but mha128's.
# dar_latent keeps d_c = d_down and 4 rotary pairs per kv head on each; DAR d_down.
SHAPES = {"small": (LAYERS, HIDDEN, HEADS, HEADS, 688, 64),  # the default; --kv-heads sets its kv heads
          "smollm2": (30, 576, 9, 3, 1536, 144),  # SmolLM2-135M's attention and depth, d_c = d / 4
          "gqa": (4, 256, 4, 2, 688, 64),  # 4 heads over 2 kv heads, d_c = d / 4
          "mha128": (4, 512, 4, 4, 1376, 128)}  # multi-head, heads of 128, d_c = d / 4


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def configs(d_down: int = 64):
    import allhere as ah

    return {"aha": ah.AHAConfig(window=256), "sliding": ah.SlidingConfig(window=256),
            "sinks": ah.SinksConfig(window=252, n_sinks=4),
            "dilated": ah.DilatedConfig(window=128, dilation=(1, 2, 3, 4)),
            "longformer": ah.LongformerConfig(window=256, global_first=4),
            "bigbird": ah.BigBirdConfig(block=64, window_blocks=3, global_blocks=1, random_blocks=1),
            "dar": ah.DARConfig(window=256, d_down=d_down),
            "dar_latent": ah.DARLatentConfig(window=256, d_down=d_down, rope_pairs=4)}


def build(root: Path, calibrate: int, mechanisms: list[str], max_len: int,
          shape: tuple = SHAPES["small"]) -> tuple[dict[str, Path], float | None]:
    """The plain folder and one per mechanism, of ``shape`` (a ``SHAPES`` value); returns them and the AHA model's
    mu_f on a prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from allhere.hf import collect_routing, convert, save_pretrained
    from allhere_recipes.model_bench import head_shares, set_routers

    tok = tokenizer()
    layers, hidden, heads, kv_heads, mlp, d_down = shape
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg).eval()
    folders, mu_f = {"plain": root / "plain"}, None
    plain.save_pretrained(folders["plain"])
    tok.save_pretrained(folders["plain"])
    for name in mechanisms:
        model = convert(LlamaForCausalLM.from_pretrained(folders["plain"], dtype=torch.float32).eval(),
                        configs(d_down)[name])
        if name == "aha":
            ids = torch.randint(4, VOCAB, (1, calibrate), generator=torch.Generator().manual_seed(1))
            run = lambda x: model(x, use_cache=False).logits  # noqa: E731
            set_routers(model, run, ids, head_shares(layers, heads))
            with torch.no_grad():
                run(ids)
            mu_f = float(collect_routing(model).mu_f())
        folders[name] = root / name
        save_pretrained(model, folders[name])
        tok.save_pretrained(folders[name])
    return folders, mu_f


def real_prompts(folder: Path, lengths: list[int], count: int) -> dict[int, list[list[int]]]:
    """``count`` prompts of each length in ``lengths``, as token ids of the model in ``folder``: consecutive
    stretches of the standard library's held-out files (``allhere.data.corpus``), longest file first."""
    from transformers import AutoTokenizer

    from allhere.data.corpus import stdlib_corpus

    tok = AutoTokenizer.from_pretrained(str(folder))
    docs = sorted((tok(d.numpy().tobytes().decode("utf-8", "replace"), add_special_tokens=False)["input_ids"]
                   for d in stdlib_corpus().val_docs), key=len, reverse=True)
    stream = [t for d in docs for t in d]
    out = {}
    for n in lengths:
        if len(stream) < n * count:
            raise SystemExit(f"the held-out text has {len(stream)} tokens, fewer than {count} prompts of {n}")
        out[n] = [stream[i * n:(i + 1) * n] for i in range(count)]
    return out


class Server:
    def __init__(self, folder: Path, port: int, max_len: int, kv_gib: float, dtype: str = "float32") -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "allhere.cli", "serve", "--model", str(folder), "--port",
                                      str(port), "--dtype", dtype, "--max-model-len", str(max_len),
                                      "--kv-cache-gib", str(kv_gib)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "ALLHERE_SERVE_STATS_EVERY": "1"})
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        while not any("OpenAI-compatible" in line for line in self.lines):
            if self.proc.poll() is not None:
                raise SystemExit("".join(self.lines))
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


class KVPoll:
    """The highest vllm:kv_cache_usage_perc seen on the server's /metrics while it runs."""

    def __init__(self, port: int) -> None:
        self.url, self.peak, self.stop = f"http://127.0.0.1:{port}/metrics", 0.0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                text = urllib.request.urlopen(self.url, timeout=5).read().decode()
                for m in re.finditer(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)$", text, re.M):
                    self.peak = max(self.peak, float(m.group(1)))
            except OSError:
                pass
            self.stop.wait(0.05)

    def close(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.peak


def one_request(client, name: str, prompt: str | list[int], new: int) -> tuple[float, int, float, float, list]:
    """(time to first token, new tokens, first and last token's times after the start, and every streamed chunk's
    (time since ``client``'s clock origin, new tokens so far)) of one streamed completion of ``prompt`` (text, or
    token ids)."""
    start = time.perf_counter()
    first = last = None
    tokens, trace = 0, []
    stream = client.completions.create(model=name, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True, "min_tokens": new})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter() - start
            first = first if first is not None else last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            trace.append((time.perf_counter(), tokens))
    return first, tokens, first, last, trace


def steady_rate(traces: list[list]) -> float | None:
    """Tokens/s while every request of a batch decodes and none prefills: from the last request's first token to
    the first request's last (None when they do not overlap: raise --new)."""
    t0 = max(next(t for t, n in tr if n > 0) for tr in traces)
    t1 = min(tr[-1][0] for tr in traces)
    if t1 <= t0:
        return None
    at = lambda tr, t: max((n for u, n in tr if u <= t), default=0)  # noqa: E731
    return sum(at(tr, t1) - at(tr, t0) for tr in traces) / (t1 - t0)


def workload(port: int, name: str, prompts: list, new: int, rounds: int, rounds16: int, prompt_len: int,
             kv_bytes: float) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    one_request(client, name, prompts[0], 2)  # warm-up
    out, fresh = {}, iter(prompts[1:])  # every request its own prompt: no prefix-cache hits
    for batch, n_rounds in ((1, rounds), (16, rounds16)):
        if n_rounds == 0:
            continue
        ttft, walls, tokens, decode_tokens, decode_time, steady = [], [], 0, 0, 0.0, []
        poll = KVPoll(port) if batch == 1 else None
        for _ in range(n_rounds):
            start = time.perf_counter()
            group = [next(fresh) for _ in range(batch)]
            with ThreadPoolExecutor(batch) as pool:
                results = list(pool.map(lambda p: one_request(client, name, p, new), group))
            walls.append(time.perf_counter() - start)
            ttft += [t for t, _, _, _, _ in results]
            tokens += sum(n for _, n, _, _, _ in results)
            decode_tokens += sum(n - 1 for _, n, _, _, _ in results)
            decode_time += sum(b - a for _, _, a, b, _ in results)
            steady.append(steady_rate([r[4] for r in results]) if batch > 1 else None)
        out[batch] = {"ttft": statistics.median(ttft), "tokens_per_s": tokens / sum(walls),
                      "decode_per_s": batch * decode_tokens / decode_time,
                      "steady_per_s": statistics.median(steady) if None not in steady else None}
        if poll is not None:
            out["kv_per_token"] = poll.close() * kv_bytes / (prompt_len + new)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192], help="prompt lengths (default 2048 8192)")
    p.add_argument("--new", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--rounds", type=int, default=2, help="batch-1 requests per prompt length (default 2)")
    p.add_argument("--rounds16", type=int, default=1, help="rounds of 16 concurrent requests (default 1)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="each server's KV cache (default 4)")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--quick", action="store_true")
    names = list(configs())
    p.add_argument("--mechanisms", nargs="+", choices=names, default=names,
                   help="converted models to serve against the plain one (default: all)")
    p.add_argument("--real", type=Path, nargs="+", default=None, metavar=("RUN", "MODEL"),
                   help="a finished real-model job's folder (RUN/control/model against RUN/aha/model, or against "
                        "MODEL) instead of the random model")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                   help="served dtype (default float32; with --real auto: the dtype the folders were saved in)")
    p.add_argument("--kv-heads", type=int, default=HEADS, choices=[h for h in range(1, HEADS + 1) if HEADS % h == 0],
                   help=f"the small random model's kv heads (default {HEADS}: multi-head; fewer: grouped-query)")
    p.add_argument("--shape", default="small", choices=list(SHAPES),
                   help="the random model's shape (default small: 4 layers, d 256, 4 heads of 64; smollm2: "
                        "SmolLM2-135M's 30 layers of 9 heads over 3; gqa: 4 heads over 2; mha128: heads of 128)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="write the random model's folders here and keep them (for serve_profile.py)")
    a = p.parse_args()
    if a.shape != "small" and a.kv_heads != HEADS:
        p.error("--kv-heads sets the small shape's kv heads; the other shapes fix theirs")
    shape = SHAPES[a.shape] if a.shape != "small" else SHAPES["small"][:3] + (a.kv_heads,) + SHAPES["small"][4:]
    if a.quick:
        a.prompts, a.new, a.rounds, a.rounds16 = [256], 16, 2, 1
    max_len = max(a.prompts) + a.new + 64
    count = 1 + a.rounds + 16 * a.rounds16
    if a.real is not None:
        if len(a.real) > 2:
            p.error("--real takes a run folder and at most one converted model")
        run, model = a.real[0], (a.real[1] if len(a.real) == 2 else a.real[0] / "aha" / "model")
        kind = json.loads((model / "config.json").read_text()).get("allhere_mechanism", {}).get("kind", "converted")
        folders, mu_f = {"plain": run / "control" / "model", kind: model}, None
        prompts = real_prompts(folders["plain"], a.prompts, count)
        dtype = a.dtype or "auto"
    else:
        root = a.keep or Path(tempfile.mkdtemp(prefix="serve-bench-"))
        folders, mu_f = build(root, min(max(a.prompts), 4096), list(dict.fromkeys(a.mechanisms)), max(max_len, 4096),
                              shape)
        g = torch.Generator().manual_seed(2)
        prompts = {n: [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 4, (n - 1,), generator=g))
                       for _ in range(count)] for n in a.prompts}  # + BOS = n tokens each
        dtype = a.dtype or "float32"
    load = lambda: " ".join(f"{x:.2f}" for x in os.getloadavg())  # noqa: E731
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; prompts {a.prompts} tokens, "
          f"{a.new} new, batch 1 x {a.rounds}, batch 16 x {a.rounds16}; KV cache {a.kv_cache_gib} GiB; dtype {dtype}"
          + (f"; shape {a.shape}: {shape[0]} layers, d {shape[1]}, {shape[2]} heads over {shape[3]} kv heads, "
             f"d_down {shape[5]}" if a.real is None else "")
          + (f"; real model: {' against '.join(map(str, a.real))}" if a.real is not None else "")
          + (f"; AHA mu_f on a prompt {100 * mu_f:.1f}%" if mu_f is not None else ""), flush=True)
    results = {}
    kv_bytes = a.kv_cache_gib * 2 ** 30
    for name, folder in folders.items():
        print(f"# {name}: load average before {load()}", flush=True)
        server = Server(folder, a.port, max_len, a.kv_cache_gib, dtype)
        try:
            for n in a.prompts:
                results[name, n] = workload(a.port, folder.resolve().name, prompts[n], a.new, a.rounds, a.rounds16,
                                            n, kv_bytes)
                print(f"# {name} {n}: {results[name, n]}", flush=True)
            time.sleep(2)  # the last routing line
            stats = [line.strip() for line in server.lines if "mu_f" in line]
            if stats:
                print(f"# {name}: {stats[-1]}")
        finally:
            server.close()
        print(f"# {name}: load average after {load()}", flush=True)
    def kv(r, pl=None):  # a request shorter than the polling interval leaves no reading
        if not r.get("kv_per_token") or (pl is not None and not pl.get("kv_per_token")):
            return "n/a"
        return f"{r['kv_per_token']:.0f}" if pl is None else f"{r['kv_per_token'] / pl['kv_per_token']:.2f}x"

    def steady(b, pb):
        if b.get("steady_per_s") is None or pb.get("steady_per_s") is None:
            return "n/a | n/a"
        return f"{b['steady_per_s']:.1f} | {b['steady_per_s'] / pb['steady_per_s']:.2f}x"

    print("| model | prompt | batch | TTFT ms | vs plain | decode tokens/s | vs plain | all decoding, tokens/s "
          "| vs plain | output tokens/s | vs plain | KV bytes / token | vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in folders:
        for n in a.prompts:
            for batch in (b for b in (1, 16) if b in results[name, n]):
                pl, r = results["plain", n], results[name, n]
                b, pb = r[batch], pl[batch]
                print(f"| {name} | {n} | {batch} | {1e3 * b['ttft']:.0f} | {pb['ttft'] / b['ttft']:.2f}x | "
                      f"{b['decode_per_s']:.1f} | {b['decode_per_s'] / pb['decode_per_s']:.2f}x | {steady(b, pb)} | "
                      f"{b['tokens_per_s']:.1f} | {b['tokens_per_s'] / pb['tokens_per_s']:.2f}x | "
                      f"{kv(r)} | {kv(r, pl)} |")
    print(f"# load average at the end: {load()}")


if __name__ == "__main__":
    main()
