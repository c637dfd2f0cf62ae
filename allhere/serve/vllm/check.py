"""Greedy tokens of a model folder served by vLLM (one engine), for comparison with allhere's own generation.

``python -m allhere.serve.vllm.check FOLDER --prompts '[[1, 5, 9], [1, 7]]' --max-tokens 32 --forced none,true``
prints one JSON line: per forced-gate setting (``none``: routed; ``true`` / ``false``: every AHA gate
global / local), the new token ids of every prompt and the routing statistics of that generation. The
engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), in float32, eager (no torch.compile)
unless ``--compiled``.

``python -m allhere.serve.vllm.check --jobs`` reads checks from stdin instead, one per line, each the JSON list
of its arguments (``["FOLDER", "--prompts", "[[1, 5, 9]]", "--forced", "none,true"]``), and prints one
``ALLHERE_VLLM_RESULT`` line per check (``ALLHERE_VLLM_ERROR`` and the error where it failed) until stdin
ends: one process pays vLLM's import once (about 8 of a check's 11 s on 2 CPU cores), each engine after the
first starts in 2-3 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from functools import partial

SETTINGS = {"none": None, "true": True, "false": False}


def held_blocks(llm, prompt: list[int], params) -> tuple[list[int], list[int]]:
    """Generate from one prompt step by step: the KV cache blocks the engine holds after each step (from its
    block pool's free count) and the new tokens."""
    engine = llm.llm_engine
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool  # the engine runs in this process
    free = pool.get_num_free_blocks()
    engine.add_request("held", {"prompt_token_ids": prompt}, params)
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        held.append(free - pool.get_num_free_blocks())
    return held, tokens


def greedy(path: str, prompts: list[list[int]], max_tokens: int = 32, forced=(None,), max_model_len: int = 512,
           block_size: int = 32, again: bool = False, compiled: bool = False, held: int = 0,
           dtype: str = "float32", step_tokens: int | None = None) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model below hands the engine functions
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is far larger
    from vllm import LLM, SamplingParams

    from .model import reset_routing_stats, routing_stats, set_forced_gate
    from .plugin import register

    register()  # where the entry point is installed vLLM has done it already; idempotent
    # small blocks (the CPU's smallest): a prompt and its completion span several, as a long context would
    # ``step_tokens``: the most tokens a step schedules, so that a long prompt is read in chunks while the
    # others decode beside it (steps that mix decode and prefill)
    steps = {} if step_tokens is None else {"max_num_batched_tokens": step_tokens, "max_num_seqs": len(prompts)}
    llm = LLM(model=path, dtype=dtype, enforce_eager=not compiled, max_model_len=max_model_len, seed=0,
              block_size=block_size, **steps)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results = {}
    for value in forced:
        routed = llm.apply_model(partial(set_forced_gate, value=value))[0] > 0
        if value is not None and not routed:
            raise ValueError(f"{path}: no AHA layer whose gate could be forced")
        llm.apply_model(reset_routing_stats)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        key = {None: "none", True: "true", False: "false"}[value]
        results[key] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "routing": llm.apply_model(routing_stats)[0] if routed else None,
                        "kv": llm.apply_model(lambda model: getattr(model, "allhere_kv", None))[0]}
        if again:  # the same prompts once more: their full blocks now come from vLLM's prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            results[key]["again"] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                     "cached": [o.num_cached_tokens for o in outs]}
        if held:  # the last prompt alone, ``held`` new tokens, the blocks it holds after each step
            results[key]["held"], results[key]["held_tokens"] = held_blocks(
                llm, prompts[-1], SamplingParams(temperature=0.0, max_tokens=held, ignore_eos=True))
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m allhere.serve.vllm.check", description=__doc__.split("\n")[0],
                                epilog="python -m allhere.serve.vllm.check --jobs: checks from stdin, one JSON list "
                                       "of these arguments per line, one result line each")
    p.add_argument("model", help="a model folder (plain, or written by allhere convert)")
    p.add_argument("--prompts", required=True, help="JSON list of prompts, each a list of token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--forced", default="none", help="comma-separated: none, true, false")
    p.add_argument("--again", action="store_true", help="generate each setting's prompts a second time (prefix cache)")
    p.add_argument("--compiled", action="store_true", help="vLLM's default torch.compile instead of eager")
    p.add_argument("--max-model-len", type=int, default=512, help="longest prompt + new tokens (default 512)")
    p.add_argument("--held", type=int, default=0, metavar="N",
                   help="also generate N tokens from the last prompt alone and report the KV blocks held per step")
    p.add_argument("--step-tokens", type=int, default=None, metavar="N",
                   help="schedule at most N tokens a step (a long prompt read in chunks beside decoding requests)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the served dtype (default float32)")
    return p


def check(argv: list[str]) -> dict:
    """One check from its arguments (``parser``); the engine is gone when it returns."""
    args = parser().parse_args(argv)
    forced = [SETTINGS[s.strip().lower()] for s in args.forced.split(",")]
    out = greedy(args.model, json.loads(args.prompts), args.max_tokens, forced, max_model_len=args.max_model_len,
                 again=args.again, compiled=args.compiled, held=args.held, dtype=args.dtype,
                 step_tokens=args.step_tokens)
    gc.collect()  # the engine's model and KV cache, before the next check builds its own
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--jobs"]:
        print("ALLHERE_VLLM_RESULT " + json.dumps(check(argv)), flush=True)
        return
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
            if not isinstance(job, list) or not all(isinstance(a, str) for a in job):
                raise ValueError(f"a job is a JSON list of argument strings, got {line.strip()[:200]}")
            print("ALLHERE_VLLM_RESULT " + json.dumps(check(job)), flush=True)
        except (Exception, SystemExit) as err:  # argparse exits on a bad argument: report it, take the next job
            detail = traceback.format_exc(limit=-3) if isinstance(err, Exception) else f"bad arguments (exit {err})"
            print("ALLHERE_VLLM_ERROR " + json.dumps(detail), flush=True)


if __name__ == "__main__":
    main()
