"""``allhere bench --tables model``: a whole model on a GPU, plain against converted to AHA, as a user runs it.

The model has the published shape of Llama-3.2-1B (hidden 2048, 16 layers, 32 query heads and 8 KV heads
of 64, SwiGLU 8192, vocabulary 128256, tied embeddings, llama3 RoPE scaling, rope_theta 500000) with random
bf16 weights built from a ``LlamaConfig`` (nothing is downloaded). The plain model runs transformers' SDPA;
the converted one is the same weights through ``allhere.hf.convert(model, AHAConfig(window=256))`` with its
routers set long-tailed at mu_f 7% (``model_bench.set_routers``: in every layer head 0 always global, the
other 31 heads global for 4% of the tokens each, as the op bench's long-tailed gates).

- **Prefill** (B = 1): one forward of the prompt (no cache, the last token's logits, as ``generate``'s
  first step keeps), tokens/s of plain, AHA and AHA with every gate local (the most any gates can give:
  projections and MLPs cost the same in both models).
- **Decode** (B = 8): ``model.generate`` on a cache already holding the context, timing only the new
  tokens' steps (a logits processor stamps each step; warm-up tokens first, untimed). The caches are filled
  with the model's own keys and values of a short prompt, repeated to the context (a decode step's cost
  does not depend on the values; mu_f is measured on the steps). Plain: transformers' DynamicCache
  (``generate``'s default, which concatenates the cache at every step) and allhere's in-place layers
  (``InPlaceLayer``); AHA: ``allhere.hf.new_cache(model, reserve=)``, the cache ``allhere generate`` uses.
  Each cache's bytes (its capacity, and the tokens it holds) and the GPU's peak memory are printed.

The plain model runs twice, under torch's own choice of SDPA backend and with only the flash and
memory-efficient backends allowed (``torch.nn.attention.sdpa_kernel``): on an H200 torch picks cuDNN, which
builds a new plan whenever the cache length changes -- about 3 ms of host time per layer and decode step --
so a decode step of the plain model is several times faster without it. Ratios are against the fastest
plain row of the same run. On the CPU (``--device cpu``) the model shrinks
to the same structure at toy sizes (as the tests shrink the published config) and the lengths to a few
hundred tokens: a smoke test of the command, not a measurement.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import time

import torch

from .gates import flop_limit
from .timing import median_time, timed_call

LLAMA_3_2_1B = dict(  # the published config.json of meta-llama/Llama-3.2-1B (sizes and structural flags)
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu", bos_token_id=128000,
    eos_token_id=128001)
SMOKE_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=2)  # the tests' shrunk 1B


@dataclasses.dataclass
class LlamaTables:
    """What ``allhere bench --tables model`` measures (``llama_tables`` fills the defaults per device)."""

    device: str = "cuda"
    smoke: bool = False  # the toy shape and lengths of the CPU's smoke test
    window: int = 256
    mu: float = 0.07  # long-tailed: head 0 of every layer global, the others at the rest
    prefill_lengths: tuple = (8192, 32768)
    contexts: tuple = (32768, 131072)
    batch: int = 8
    new_tokens: int = 32  # decode steps timed per row (the first step after the warm-up excluded)
    warmup_tokens: int = 4
    seed_tokens: int = 2048  # the prompt whose keys and values fill the caches, repeated
    calibrate_tokens: int = 2048  # tokens the routers' shares are set on
    repeats: int = 3


def llama_tables(device: str, **given) -> LlamaTables:
    """The settings for ``device``: on the CPU the smoke test's toy sizes, unless given."""
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    if device == "cpu":
        small = dict(smoke=True, window=16, prefill_lengths=(256,), contexts=(128, 256), batch=2, new_tokens=3,
                     warmup_tokens=1, seed_tokens=64, calibrate_tokens=256, repeats=1)
        given = {**small, **given}
    return LlamaTables(device=device, **given)


def build_models(t: LlamaTables):
    """(plain, AHA): the model of ``t``'s shape on its device (bf16 on a GPU), and a converted copy whose
    routers are set long-tailed at ``t.mu`` (on ``t.calibrate_tokens`` random tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from allhere import AHAConfig
    from allhere.hf import convert

    from .model_bench import head_shares, set_routers

    shape = {**LLAMA_3_2_1B, **(SMOKE_SHAPE if t.smoke else {})}
    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(t.device):
        plain = LlamaForCausalLM(cfg)
    plain = plain.to(torch.bfloat16 if t.device.startswith("cuda") else torch.float32).eval()
    aha = convert(copy.deepcopy(plain), AHAConfig(window=t.window))
    ids = torch.randint(0, cfg.vocab_size, (1, t.calibrate_tokens), generator=torch.Generator().manual_seed(1))
    set_routers(aha, lambda x: aha(x.to(t.device), use_cache=False, logits_to_keep=1), ids,
                head_shares(cfg.num_hidden_layers, cfg.num_attention_heads, t.mu))
    return plain, aha


def _peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


PLAIN_BACKENDS = {"torch's choice": None, "flash/efficient only": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")}


def sdpa_backends(choice: str):
    """A context in which SDPA calls use the backends of ``PLAIN_BACKENDS[choice]`` (None: torch's choice)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = PLAIN_BACKENDS[choice]
    return contextlib.nullcontext() if names is None else sdpa_kernel([getattr(SDPBackend, n) for n in names])


def prefill_rows(t: LlamaTables, plain, aha, progress=print) -> list[dict]:
    """Per prefill length: the forward's time of plain, AHA and AHA with every gate local, and mu_f."""
    from allhere.hf import collect_routing
    from allhere.routing import set_forced_gate

    rows = []
    for n in t.prefill_lengths:
        ids = torch.randint(0, plain.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(2))
        ids = ids.to(t.device)
        row, plain_runs = {"n": n}, {}
        runs = [*((c, plain, None) for c in PLAIN_BACKENDS), ("aha", aha, None), ("local", aha, False)]
        for name, model, forced in runs:
            _reset_peak(t.device)
            if model is aha:
                set_forced_gate(aha, forced)
            with torch.inference_mode(), sdpa_backends(name if model is plain else "torch's choice"):
                s = median_time(lambda: model(ids, use_cache=False, logits_to_keep=1), t.repeats, device=t.device)
                if name == "aha":
                    row["mu_f"] = float(collect_routing(aha).mu_f())
            timed = (1e3 * s, _peak_gb(t.device))
            if model is plain:
                plain_runs[name] = timed
            else:
                row[f"{name}_ms"], row[f"{name}_peak_gb"] = timed
        set_forced_gate(aha, None)
        row["plain_backend"] = min(plain_runs, key=lambda c: plain_runs[c][0])  # the faster choice is the baseline
        row["plain_ms"], row["plain_peak_gb"] = plain_runs[row["plain_backend"]]
        row["plain_by_backend"] = {c: ms for c, (ms, _) in plain_runs.items()}
        row.update(speedup=row["plain_ms"] / row["aha_ms"], ceiling=row["plain_ms"] / row["local_ms"],
                   flop_limit=prefill_flop_limit(plain, t, n, row["mu_f"]),
                   plain_tokens_per_s=n / row["plain_ms"] * 1e3, aha_tokens_per_s=n / row["aha_ms"] * 1e3)
        rows.append(row)
        progress(f"whole-model prefill {row}")
    return rows


def decode_rows(t: LlamaTables, plain, aha, progress=print) -> list[dict]:
    """Per context: one row per (model, cache), decode steps through ``generate`` (``generate_bench``)."""
    from transformers.cache_utils import Cache, DynamicCache

    from allhere.hf import new_cache
    from allhere.hf.cache import InPlaceLayer
    from allhere.routing import set_forced_gate

    from .generate_bench import decode_steps, fill, seed_kv

    rows = []
    # the routed and the all-local runs continue one cache: twice the warm-up and timed tokens (+2 to spare);
    # short of it a 128k-token buffer would double at the end
    room = 2 * (t.warmup_tokens + t.new_tokens) + 2
    layers = plain.config.num_hidden_layers
    seeds = {name: seed_kv(m, t.seed_tokens, t.device) for name, m in (("plain", plain), ("aha", aha))}
    for ctx in t.contexts:
        ids = torch.randint(0, plain.config.vocab_size, (t.batch, ctx + 1), generator=torch.Generator().manual_seed(3))
        ids = ids.to(t.device)

        def in_place():
            cache = Cache(layers=[InPlaceLayer() for _ in range(layers)])
            for layer in cache.layers:
                layer.reserve(ctx + room)
            return cache

        backends = tuple(f"SDPA, {c}" for c in PLAIN_BACKENDS)
        runs = (("plain", "DynamicCache (generate's default: concatenates)", plain,
                 lambda: DynamicCache(config=plain.config), backends),
                ("plain", "in place (allhere InPlaceLayer)", plain, in_place, backends),
                ("AHA", "in place (allhere.hf.new_cache)", aha, lambda: new_cache(aha, reserve=ctx + room),
                 ("routed", "every gate local (ceiling)")))
        for model_name, cache_name, model, make, modes in runs:
            _reset_peak(t.device)
            cache = seq = None
            for mode in modes:
                if model is plain:
                    name = f"plain (transformers {mode})"
                else:
                    name = model_name if mode == "routed" else f"{model_name}, {mode}"
                row = {"context": ctx, "batch": t.batch, "model": name, "cache": cache_name}
                try:  # one row out of memory (an 80 GB GPU at 128k) leaves the others
                    if cache is None:
                        cache, seq = fill(make(), seeds["aha" if model is aha else "plain"], t.batch, ctx), ids
                    if model is aha:
                        set_forced_gate(aha, False if mode.startswith("every") else None)
                    with sdpa_backends(mode.removeprefix("SDPA, ") if model is plain else "torch's choice"):
                        steps, seq, shares = decode_steps(model, seq, cache, t.new_tokens, t.warmup_tokens,
                                                          routed=model is aha and mode == "routed")
                except torch.OutOfMemoryError as e:
                    rows.append({**row, "error": f"out of memory: {str(e).splitlines()[0][:120]}"})
                    progress(f"whole-model decode {rows[-1]}")
                    break
                ms = 1e3 * sorted(steps)[len(steps) // 2]
                kv_global = 1.0 if model is plain else (0.0 if shares is None else shares[1])
                rows.append({**row, "ms_per_step": ms, "tokens_per_s": t.batch / ms * 1e3, "steps": len(steps),
                             "mu_f": None if shares is None else shares[0], "kv_heads_global": kv_global,
                             "byte_limit": decode_byte_limit(plain, t, ctx, kv_global),
                             "cache_gb": _cache_gb(cache), "cache_used_gb": _cache_gb(cache, used=True),
                             "peak_gb": _peak_gb(t.device)})
                progress(f"whole-model decode {rows[-1]}")
            set_forced_gate(aha, None)
            del cache, seq
        rows += captured_rows(t, plain, aha, seeds, ctx, room, rows, progress)
        plain_ms = [r["ms_per_step"] for r in rows if r["context"] == ctx and r["model"].startswith("plain")
                    and "error" not in r]
        for r in rows:
            if r["context"] == ctx and "error" not in r:
                r["speedup"] = min(plain_ms) / r["ms_per_step"] if plain_ms else None
    return rows


def captured_rows(t: LlamaTables, plain, aha, seeds: dict, ctx: int, room: int, rows: list, progress) -> list[dict]:
    """Per model, decode steps over transformers' StaticCache filled to ``ctx``, the step captured once and
    replayed (``CapturedDecode``; run eagerly off CUDA): what both models give once Python and launches are
    off the step. AHA's routing is not read in a replay: its byte limit takes the routed row's share."""
    from allhere.hf.captured import CapturedDecode

    from .generate_bench import fill

    routed = [r for r in rows if r["context"] == ctx and r["model"] == "AHA" and "error" not in r]  # eager, routed
    out = []
    for name, model in (("plain (transformers SDPA, torch's choice), captured step", plain),
                        ("AHA, captured step", aha)):
        _reset_peak(t.device)
        how = "captured as a CUDA graph" if t.device.startswith("cuda") else "run eagerly (no CUDA)"
        row = {"context": ctx, "batch": t.batch, "model": name, "cache": f"StaticCache, one step {how} "
               "(allhere.hf.captured)"}
        run = None
        try:
            run = CapturedDecode(model, t.batch, ctx + room, capture=t.device.startswith("cuda"))
            fill(run.cache, seeds["aha" if model is aha else "plain"], t.batch, ctx)
            run.resume()
            steps = captured_steps(run, max(t.warmup_tokens, 1), t.new_tokens, t.device)  # the first captures
        except Exception as e:  # noqa: BLE001 -- a row that fails (memory, a capture) leaves the others
            out.append({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            progress(f"whole-model decode {out[-1]}")
            del run
            continue
        ms = 1e3 * sorted(steps)[len(steps) // 2]
        kv_global = 1.0 if model is plain else (routed[0]["kv_heads_global"] if routed else 0.0)
        out.append({**row, "ms_per_step": ms, "tokens_per_s": t.batch / ms * 1e3, "steps": len(steps),
                    "mu_f": None, "kv_heads_global": kv_global,
                    "byte_limit": decode_byte_limit(plain, t, ctx, kv_global),
                    "cache_gb": _cache_gb(run.cache), "cache_used_gb": _cache_gb(run.cache, used=True),
                    "peak_gb": _peak_gb(t.device)})
        progress(f"whole-model decode {out[-1]}")
        del run
    return out


def captured_steps(run, warmup: int, new_tokens: int, device: str) -> list[float]:
    """Seconds of each greedy step of ``run`` (a ``CapturedDecode`` resumed on a filled cache) after
    ``warmup`` untimed ones (the first captures the graph): ``new_tokens - 1``, as many as ``decode_steps``
    times between ``new_tokens`` tokens."""
    token = torch.zeros(run.batch, dtype=torch.long, device=run.device)
    times = []
    for i in range(warmup + new_tokens - 1):
        token, seconds = timed_call(lambda: run.step(token).argmax(-1), device)
        if i >= warmup:
            times.append(seconds)
    return times


def prefill_flop_limit(model, t: LlamaTables, n: int, mu: float) -> float:
    """The whole model's prefill speed-up limit from FLOPs: the layers' matrix products (2 per weight per
    token, the same in both models) plus causal attention (dense: n^2 / 2 scores per head, AHA: the share
    ``gates.flop_limit`` gives)."""
    c = model.config
    weights = sum(p.numel() for p in model.model.layers.parameters())
    linear = 2.0 * weights * n
    attention = c.num_hidden_layers * c.num_attention_heads * 4 * c.head_dim * n * n / 2
    return (linear + attention) / (linear + attention / flop_limit(mu, t.window, n))


def decode_byte_limit(model, t: LlamaTables, context: int, kv_global: float) -> float:
    """A decode step's speed-up limit from the bytes it reads: every weight once, and the cache -- all of it
    for a KV head one of whose query heads is global (a share ``kv_global`` of them), the last w tokens
    for the others."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * (2 if t.device != "cpu" else 4)
    dense = weights + per_token * t.batch * context
    local = min(t.window, context)
    return dense / (weights + per_token * t.batch * (kv_global * context + (1 - kv_global) * local))


def _cache_gb(cache, used: bool = False) -> float:
    from allhere.hf import cache_nbytes

    return cache_nbytes(cache, used=used) / 1e9


def run_llama_tables(t: LlamaTables, progress=print) -> dict:
    """The prefill and decode tables of ``t``, with the shape, versions and the machine's load."""
    import transformers

    load = os.getloadavg()
    start = time.perf_counter()
    plain, aha = build_models(t)
    progress(f"models built and routers set in {time.perf_counter() - start:.0f} s")
    report = {"settings": dataclasses.asdict(t), "shape": {**LLAMA_3_2_1B, **(SMOKE_SHAPE if t.smoke else {})},
              "transformers": transformers.__version__, "load_before": load,
              "parameters": sum(p.numel() for p in plain.parameters())}
    report["prefill"] = prefill_rows(t, plain, aha, progress)
    report["decode"] = decode_rows(t, plain, aha, progress)
    report["load_after"] = os.getloadavg()
    return report


def render_llama(r: dict) -> list[str]:
    t, s = r["settings"], r["shape"]
    gb = lambda x: "n/a" if x is None else f"{x:.1f} GB"  # noqa: E731
    title = "SMOKE TEST on the CPU (toy shape and lengths): not a measurement" if t["smoke"] else \
        "Llama-3.2-1B shape, random bf16 weights"
    out = [f"## Whole model: {title}", "",
           f"{r['parameters'] / 1e6:,.0f}M parameters: hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, "
           f"{s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads of {s['head_dim']}, vocabulary "
           f"{s['vocab_size']}; transformers {r['transformers']}. AHA: w = {t['window']}, routers set long-tailed at "
           f"mu_f {100 * t['mu']:.0f}% (head 0 of every layer global). Load average before "
           f"{' '.join(f'{x:.2f}' for x in r['load_before'])}, after {' '.join(f'{x:.2f}' for x in r['load_after'])}.",
           "", "### Prefill (B = 1, one forward of the prompt, last token's logits)", "",
           "| n | mu_f | plain (fastest SDPA choice) | AHA | AHA / plain | FLOP limit | plain tokens/s | AHA tokens/s "
           "| every gate local (ceiling) | peak plain / AHA |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["prefill"]:
        others = ", ".join(f"{c}: {ms:.1f} ms" for c, ms in p["plain_by_backend"].items() if c != p["plain_backend"])
        out.append(f"| {p['n']} | {100 * p['mu_f']:.1f}% | {p['plain_ms']:.1f} ms ({p['plain_backend']}; {others}) "
                   f"| {p['aha_ms']:.1f} ms "
                   f"| {p['speedup']:.2f}x | {p['flop_limit']:.2f}x | {p['plain_tokens_per_s']:,.0f} "
                   f"| {p['aha_tokens_per_s']:,.0f} | {p['ceiling']:.2f}x | {gb(p['plain_peak_gb'])} / "
                   f"{gb(p['aha_peak_gb'])} |")
    warm = f"{t['warmup_tokens']} untimed token" + ("s" if t["warmup_tokens"] != 1 else "")
    out += ["", f"### Decode (B = {t['batch']}, `generate` on a filled cache, {t['new_tokens']} new tokens timed "
            f"after {warm}; median step)", "",
            "| context | model | cache | ms / step | tokens/s | vs fastest plain (eager or captured) | byte limit "
            "| mu_f (KV heads read "
            "whole) | cache: held / used | peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in r["decode"]:
        if "error" in d:
            out.append(f"| {d['context']} | {d['model']} | {d['cache']} | {d['error']} | | | | | | |")
            continue
        mu = "-" if d["mu_f"] is None else f"{100 * d['mu_f']:.1f}% ({100 * d['kv_heads_global']:.0f}%)"
        vs = "n/a" if d["speedup"] is None else f"{d['speedup']:.2f}x"
        out.append(f"| {d['context']} | {d['model']} | {d['cache']} | {d['ms_per_step']:.2f} | "
                   f"{d['tokens_per_s']:,.0f} | {vs} | {d['byte_limit']:.1f}x | {mu} | "
                   f"{d['cache_gb']:.2f} / {d['cache_used_gb']:.2f} GB | {gb(d['peak_gb'])} |")
    out += ["", "Limits: prefill from the FLOPs of the layers' weights and of causal attention at the measured mu_f; "
            "decode from the bytes a step reads (every weight, and per KV head the whole cache where one of its "
            "query heads is global, else the window): what a path at the dense kernels' speed would reach."]
    return out
