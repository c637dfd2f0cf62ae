"""Where a served decode step's time goes: a model folder served by vLLM in this process (allhere's plugin
registered), BATCH requests of random prompts prefilled, then decode steps timed and profiled by torch's profiler
(operators by their own time; ``--python``: cProfile's functions instead).

    .venv-serve/bin/python benchmarks/serve_profile.py runs/smollm2/dar/control/model --prompt 8000
    .venv-serve/bin/python benchmarks/serve_profile.py runs/smollm2/dar/latent-w128-d144-r4/stage2/model \
        --prompt 4096 --batch 16

(needs the serving environment: bash scripts/install_serve.sh). The engine runs as ``allhere serve`` runs it
(vLLM's torch.compile of the model, allhere's layers as custom operators), but in one process: the engine core's
own threads share it, so Python's per-operator costs read somewhat higher than in a server. It also runs on
torch's threads (every core; ``--threads``), where a server's worker runs one thread on a 2-core machine (vLLM
keeps a core for its engine and API server): the torch threads are printed, and ratios between mechanisms of many
small operators and plain can differ from a server's. ``--prefill``: the prefill's operators instead of the decode
steps'. Run the plain and the converted model one after the other on an idle machine and compare the step times
and the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model runs in this process, under the profiler
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("model", help="a model folder (plain, or written by allhere convert)")
    p.add_argument("--prompt", type=int, default=8000, help="tokens per prompt (default 8000)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    p.add_argument("--steps", type=int, default=10, help="decode steps profiled (default 10; 20 more are timed)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="served dtype")
    p.add_argument("--rows", type=int, default=30, help="operators (or functions) listed (default 30)")
    p.add_argument("--python", action="store_true", help="cProfile's Python functions instead of operators")
    p.add_argument("--prefill", action="store_true", help="profile the prefill (until every first token) instead")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads (default: every core; 1: as a server's worker on a 2-core machine)")
    a = p.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from allhere.serve.vllm.plugin import register

    register()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    steps = 5 + 20 + a.steps
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.prompt + steps + 8, seed=0,
              kv_cache_memory_bytes=3 << 30)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    vocab = min(40000, engine.model_config.get_vocab_size())  # a random model's vocabulary may be small
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": torch.randint(4, vocab, (a.prompt,), generator=gen)
                                     .tolist()}, params)
    from torch.profiler import ProfilerActivity, profile

    start, started = time.perf_counter(), set()
    with profile(activities=[ProfilerActivity.CPU]) if a.prefill else contextlib.nullcontext() as prof:
        while len(started) < a.batch:  # until every request has its first token: all decode from here on
            started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    print(f"# {a.model}: {a.batch} x {a.prompt} tokens prefilled in {time.perf_counter() - start:.1f} s"
          f"{' (profiled)' if a.prefill else ''}; torch threads {torch.get_num_threads()}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if a.prefill:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
        return
    for _ in range(5):
        engine.step()
    start = time.perf_counter()
    for _ in range(20):
        engine.step()
    print(f"# decode step: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms (mean of 20)", flush=True)
    if a.python:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.rows)
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            engine.step()
    print(f"# {a.steps} decode steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
