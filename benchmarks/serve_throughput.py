"""Serving throughput under vLLM: models converted by allhere (AHA by default) against the same model
unconverted, each behind ``allhere serve`` (vLLM's OpenAI-compatible server with allhere's plugin), in one run.

    .venv-serve/bin/python benchmarks/serve_throughput.py            # ~5 minutes on 2 CPU cores
    .venv-serve/bin/python benchmarks/serve_throughput.py --quick    # prompt 256, 16 new tokens
    .venv-serve/bin/python benchmarks/serve_throughput.py --mechanisms aha sinks dar   # + the paged ones

(needs the serving environment: bash scripts/install_serve.sh). Model: a random-weight Llama of 4 layers,
d = 256, 4 heads of 64 (fp32) and a word-level tokenizer of 1024 words, saved with transformers; the AHA
version (w = 256) has its routers set as ``allhere bench``'s whole-model table sets them (one head at 27% in
three layers, every other head at 2%: mu_f about 7%, measured on the prompts and printed). Workload:
prompts of --prompt random words, a new prompt for every request (so vLLM's prefix cache never hits), --new
greedy tokens each (ignore_eos), streamed; batch 1 (--rounds requests one after another) and batch 16 (16
concurrent requests, --rounds times). Time to first token (TTFT) is the
median over requests; output tokens/s is all new tokens over the wall time of the batch. The two servers run
one after the other (the machine has 2 cores); the load average is printed before and after. Sinks
(w = 252 + 4 sinks) and DAR (w = 256, d_down = 64) are served by allhere's reference attention over vLLM's
paged cache (docs/serving.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

VOCAB = 1024


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def build(root: Path, prompt_len: int, mechanisms: list[str]) -> tuple[dict[str, Path], float | None]:
    """The plain folder and one per mechanism; returns them and the AHA model's mu_f on a prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import allhere as ah
    from allhere.experiments.model_bench import head_shares, set_routers
    from allhere.hf import collect_routing, convert, save_pretrained

    tok = tokenizer()
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg).eval()
    folders, mu_f = {"plain": root / "plain"}, None
    plain.save_pretrained(folders["plain"])
    tok.save_pretrained(folders["plain"])
    configs = {"aha": ah.AHAConfig(window=256), "sinks": ah.SinksConfig(window=252, n_sinks=4),
               "dar": ah.DARConfig(window=256, d_down=64)}
    for name in mechanisms:
        model = convert(LlamaForCausalLM.from_pretrained(folders["plain"], dtype=torch.float32).eval(), configs[name])
        if name == "aha":
            ids = torch.randint(4, VOCAB, (1, max(prompt_len, 512)), generator=torch.Generator().manual_seed(1))
            run = lambda x: model(x, use_cache=False).logits  # noqa: E731
            set_routers(model, run, ids, head_shares(4, 4))
            with torch.no_grad():
                run(ids)
            mu_f = float(collect_routing(model).mu_f())
        folders[name] = root / name
        save_pretrained(model, folders[name])
        tok.save_pretrained(folders[name])
    return folders, mu_f


class Server:
    def __init__(self, folder: Path, port: int) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "allhere.cli", "serve", "--model", str(folder), "--port",
                                      str(port), "--dtype", "float32", "--max-model-len", "4096", "--kv-cache-gib", "2"],
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


def one_request(client, name: str, prompt: str, new: int) -> tuple[float, int, float]:
    """(time to first token, new tokens, seconds) of one streamed completion."""
    start = time.perf_counter()
    first, tokens = None, 0
    stream = client.completions.create(model=name, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "min_tokens": new})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter() - start
            tokens += 1
    return first, tokens, time.perf_counter() - start


def workload(port: int, name: str, prompts: list[str], new: int, rounds: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    one_request(client, name, prompts[0], 2)  # warm-up
    out, fresh = {}, iter(prompts[1:])  # every request its own prompt: no prefix-cache hits
    for batch in (1, 16):
        ttft, walls, tokens = [], [], 0
        for r in range(rounds):
            start = time.perf_counter()
            group = [next(fresh) for _ in range(batch)]
            with ThreadPoolExecutor(batch) as pool:
                results = list(pool.map(lambda p: one_request(client, name, p, new), group))
            walls.append(time.perf_counter() - start)
            ttft += [t for t, _, _ in results]
            tokens += sum(n for _, n, _ in results)
        out[batch] = {"ttft": statistics.median(ttft), "tokens_per_s": tokens / sum(walls)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--new", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--mechanisms", nargs="+", choices=("aha", "sinks", "dar"), default=["aha"],
                   help="converted models to serve against the plain one (default: aha)")
    a = p.parse_args()
    if a.quick:
        a.prompt, a.new, a.rounds = 256, 16, 2
    root = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    folders, mu_f = build(root, a.prompt, list(dict.fromkeys(a.mechanisms)))
    g = torch.Generator().manual_seed(2)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 4, (a.prompt - 1,), generator=g))
               for _ in range(1 + 17 * a.rounds)]  # + BOS = a.prompt tokens; one per request
    print(f"# {platform.machine()}, torch {torch.__version__}, {os.cpu_count()} cores; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; prompt {a.prompt} tokens, {a.new} new"
          + (f", AHA w = 256, mu_f on a prompt {100 * mu_f:.1f}%" if mu_f is not None else ""))
    results = {}
    for name, folder in folders.items():
        server = Server(folder, a.port)
        try:
            results[name] = workload(a.port, folder.name, prompts, a.new, a.rounds)
            time.sleep(2)  # the last routing line
            stats = [line.strip() for line in server.lines if "mu_f" in line]
            if stats:
                print(f"# {name}: {stats[-1]}")
        finally:
            server.close()
    print("| model | batch | TTFT ms | vs plain | tokens/s | vs plain |")
    print("|---|---|---|---|---|---|")
    for name in folders:
        for batch in (1, 16):
            pl, r = results["plain"][batch], results[name][batch]
            print(f"| {name} | {batch} | {1e3 * r['ttft']:.0f} | {r['ttft'] / pl['ttft']:.2f}x | "
                  f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / pl['tokens_per_s']:.2f}x |")
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
