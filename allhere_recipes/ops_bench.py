"""``allhere bench``: AHA prefill, decode and training against the fastest dense attention, in one run.

Every ratio is against the fastest dense SDPA backend measured in the same run (cuDNN, flash and
memory-efficient are each tried; those that refuse the shape are left out), prefill also against
FlexAttention's sliding window (what local-only attention costs), with the FLOP (prefill) or byte
(decode) limit next to it (``gates.flop_limit``, ``gates.byte_limit``). Before timing, each AHA path is
checked against the fp32 dense reference at a small size. Default settings: B = 1, 16 heads, head dim
128, bf16, w = 256, long-tailed and uniform gates at mu_f 7% and 25%, prefill n in 4k..64k, decode
B = 8 at n in 8k, 32k, 128k, training forward + backward at n = 16k. Writes bench.md and bench.json.

On the CPU (``--device cpu``) it runs the same code through the PyTorch paths (no Triton, no
FlexAttention): a smoke run of the op-level tables, not a measurement of the GPU goals; its main table
is the whole-model prefill (``model_bench``: allhere's Decoder and a converted Llama, dense against AHA).

``tables`` picks what runs: "ops" (all of the above) and/or "model": a Llama-3.2-1B-shaped model, plain
against converted to AHA, prefill and decode tokens/s as a user runs them (``llama_bench``; on the CPU a
smoke test at toy sizes).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from allhere.backend import use_backend
from allhere.kernels import autotune, triton_available
from allhere.ops.aha import aha_attention_fast, aha_attention_reference
from allhere.ops.ste import straight_through
from allhere.validation import ConfigError

from .gates import PATTERNS, byte_limit, flop_limit
from .report import write_report
from .timing import median_time, ms_text, stream_time

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


@dataclasses.dataclass
class BenchConfig:
    """What ``allhere bench`` measures: shapes (B = 1 prefill and training, ``decode_batch`` decode),
    window, gate patterns and their mu_f, lengths, timing repeats, and the length of the correctness check."""

    device: str = "cuda"
    heads: int = 16
    dim: int = 128
    window: int = 256
    prefill_lengths: tuple = (4096, 16384, 32768, 65536)
    decode_lengths: tuple = (8192, 32768, 131072)
    decode_batch: int = 8
    train_length: int = 16384
    mus: tuple = (0.07, 0.25)
    patterns: tuple = ("long-tailed", "uniform")
    repeats: int = 10
    check_length: int = 1024
    model_lengths: tuple = ()  # whole-model prefill (``model_bench``); on the CPU by default 2k..16k
    profile: bool = False  # also torch.profiler's op table of each AHA path (``bench_profile``)
    pin_tiles: bool = False  # the kernels' fixed launch settings (``autotune.pinned``), not tuned ones
    tables: tuple = ("ops",)  # "ops": the tables above; "model": the whole model of ``llama`` (``llama_bench``)
    llama: object = None  # ``llama_bench.LlamaTables`` of the "model" tables

    @property
    def dtype(self):
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32


def bench_config(device: str | None = None, tables=("ops",), llama: dict | None = None, **sizes) -> BenchConfig:
    """The ``BenchConfig`` of ``allhere bench``: ``sizes`` are its fields and ``llama`` those of the "model"
    tables' ``LlamaTables``, None leaves a default. Without a ``device``, the first GPU -- and a ConfigError
    where there is none (on the CPU the bench is only a smoke run of the script, which must be asked for:
    device "cpu")."""
    if device is None:
        if not torch.cuda.is_available():
            raise ConfigError("allhere bench measures the GPU kernels and found no CUDA device; pass "
                              "--device cpu for a smoke run of the script (its numbers are not the goals)")
        device = "cuda"
    unknown = set(tables) - {"ops", "model"}
    if unknown or not tables:
        raise ConfigError(f"tables must be ops and/or model, got {' '.join(tables) or 'none'}")
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in sizes.items() if v is not None}
    if device == "cpu" and "ops" in tables:
        given.setdefault("model_lengths", (2048, 4096, 8192, 16384))
    if "model" in tables:
        from .llama_bench import llama_tables

        given["llama"] = llama_tables(device, **(llama or {}))
    return BenchConfig(device=device, tables=tuple(dict.fromkeys(tables)), **given)


def fastest_dense(fn, cfg: BenchConfig) -> tuple[str, float]:
    """(backend name, seconds) of the fastest SDPA backend that accepts the call ``fn``."""
    best = None
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                t = median_time(fn, cfg.repeats, device=cfg.device)
        except RuntimeError:  # this backend does not take this shape / device
            continue
        if best is None or t < best[1]:
            best = (name, t)
    if best is None:
        with sdpa_kernel([SDPBackend.MATH]):
            best = ("math", median_time(fn, cfg.repeats, device=cfg.device))
    return best


def back_to_back(dense_fn, dense_name: str, aha_fn, cfg: BenchConfig) -> dict:
    """On CUDA, the dense call (on its fastest backend) and AHA's timed as calls issued back to back
    (``stream_time``: a model's layers issue them so, the host running ahead of the GPU): ms per call and
    their ratio. Beside the one-call times, the gap says how much of AHA's time is its host's work (the
    launches and small ops around its kernels). Empty off CUDA."""
    if not cfg.device.startswith("cuda"):
        return {}
    backend = BACKENDS.get(dense_name, SDPBackend.MATH)
    with sdpa_kernel([backend]):
        dense, _ = stream_time(dense_fn, device=cfg.device)
    aha, aha_host = stream_time(aha_fn, device=cfg.device)
    return {"dense_stream_ms": 1e3 * dense, "aha_stream_ms": 1e3 * aha, "speedup_stream": dense / aha,
            "aha_host_ms": 1e3 * aha_host}


def flex_sliding(q, k, v, window: int):
    """A callable running FlexAttention's sliding window (compiled), or None off CUDA."""
    if not q.is_cuda:
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from allhere.masks import sliding_window

    n = q.shape[2]
    block = create_block_mask(sliding_window(window), None, None, n, n, device=q.device)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=block)


def _qkv(cfg: BenchConfig, b: int, lq: int, lk: int, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    make = lambda n: torch.randn(b, cfg.heads, n, cfg.dim, device=cfg.device, generator=g,  # noqa: E731
                                 dtype=cfg.dtype).requires_grad_(requires_grad)
    return make(lq), make(lk), make(lk)


def _gate(cfg: BenchConfig, pattern: str, b: int, lq: int, mu: float, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    return PATTERNS[pattern](b, cfg.heads, lq, mu, generator=g, device=cfg.device)


def check_paths(cfg: BenchConfig) -> dict:
    """Relative errors of the AHA prefill, decode and training paths against the fp32 reference."""
    n, w = cfg.check_length, min(cfg.window, cfg.check_length // 4)
    q, k, v = _qkv(cfg, 2, n, n)
    gate = _gate(cfg, "long-tailed", 2, n, 0.07)
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    f32 = [t.float() for t in (q, k, v)]
    with torch.no_grad():
        prefill = rel(aha_attention_fast(q, k, v, gate, w), aha_attention_reference(*f32, gate, w))
        decode = rel(aha_attention_fast(q[:, :, -1:], k, v, gate[..., -1:], w),
                     aha_attention_reference(f32[0][:, :, -1:], *f32[1:], gate[..., -1:], w))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    scores = torch.rand(2, cfg.heads, n, device=cfg.device, requires_grad=True)
    up = torch.randn_like(q, dtype=torch.float32)
    fast = aha_attention_fast(qg, kg, vg, straight_through(scores, 0.5), w)
    grads = torch.autograd.grad((fast.float() * up).sum(), [qg, kg, vg, scores])
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    sr = scores.detach().requires_grad_()
    ref = aha_attention_reference(qr, kr, vr, straight_through(sr, 0.5), w)
    grads_ref = torch.autograd.grad((ref * up).sum(), [qr, kr, vr, sr])
    train = max(rel(a, b) for a, b in zip(grads, grads_ref))
    return {"prefill": prefill, "decode": decode, "training_grads": train}


def prefill_inputs(cfg: BenchConfig, n: int, pattern: str, mu: float):
    """q, k, v, gate of a prefill of one sequence of n tokens."""
    return (*_qkv(cfg, 1, n, n), _gate(cfg, pattern, 1, n, mu))


def bench_prefill(cfg: BenchConfig, n: int, pattern: str, mu: float) -> dict:
    q, k, v, gate = prefill_inputs(cfg, n, pattern, mu)
    with torch.no_grad():
        dense_name, dense = fastest_dense(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), cfg)
        flex_fn = flex_sliding(q, k, v, cfg.window)
        flex = median_time(flex_fn, cfg.repeats, device=cfg.device) if flex_fn else None
        aha_fn = lambda: aha_attention_fast(q, k, v, gate, cfg.window)  # noqa: E731
        aha = median_time(aha_fn, cfg.repeats, device=cfg.device)
        streamed = back_to_back(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dense_name, aha_fn,
                                cfg)
    mu_real = gate.float().mean().item()
    return {"n": n, "pattern": pattern, "mu_asked": mu, "mu_f": mu_real, "dense_backend": dense_name,
            "dense_ms": 1e3 * dense, "flex_sliding_ms": None if flex is None else 1e3 * flex, "aha_ms": 1e3 * aha,
            "speedup": dense / aha, "limit": flop_limit(mu_real, cfg.window, n), **streamed}


def decode_inputs(cfg: BenchConfig, n: int, pattern: str, mu: float):
    """q, k, v, gate of one decode step: ``cfg.decode_batch`` sequences, one query each, n cached keys."""
    b = cfg.decode_batch
    q, k, v = _qkv(cfg, b, 1, n)
    gate = _gate(cfg, pattern, b, 1, mu)
    if pattern == "long-tailed":  # one token per sequence: take head 0 global, the others at the rest
        gate[:, 0] = True
    return q, k, v, gate


def bench_decode(cfg: BenchConfig, n: int, pattern: str, mu: float) -> dict:
    b = cfg.decode_batch
    q, k, v, gate = decode_inputs(cfg, n, pattern, mu)
    with torch.no_grad():
        dense_name, dense = fastest_dense(lambda: F.scaled_dot_product_attention(q, k, v), cfg)
        aha_fn = lambda: aha_attention_fast(q, k, v, gate, cfg.window)  # noqa: E731
        aha = median_time(aha_fn, cfg.repeats, device=cfg.device)
        streamed = back_to_back(lambda: F.scaled_dot_product_attention(q, k, v), dense_name, aha_fn, cfg)
        kv, vv = cache_views(k, v)
        in_cache = median_time(lambda: aha_attention_fast(q, kv, vv, gate, cfg.window), cfg.repeats, device=cfg.device)
    mu_real = gate.float().mean().item()
    return {"n": n, "batch": b, "pattern": pattern, "mu_asked": mu, "mu_f": mu_real, "dense_backend": dense_name,
            "dense_ms": 1e3 * dense, "aha_ms": 1e3 * aha, "speedup": dense / aha,
            "limit": byte_limit(mu_real, cfg.window, n), "aha_cache_view_ms": 1e3 * in_cache, **streamed}


CACHE_ROOM = 4096  # spare tokens of the buffer the decode's cache views lie in


def cache_views(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v copied into the first tokens of buffers ``CACHE_ROOM`` tokens longer and returned as views of
    them, as an in-place KV cache hands its keys to attention (not contiguous: a kernel that copied them
    first would pay for the whole cache at every step)."""
    def view(t):
        buf = t.new_empty(*t.shape[:2], t.shape[2] + CACHE_ROOM, t.shape[3])
        buf[:, :, :t.shape[2]] = t
        return buf[:, :, :t.shape[2]]
    return view(k), view(v)


def training_steps(cfg: BenchConfig, pattern: str, mu: float):
    """(gate, dense step, AHA step): forward + backward at ``cfg.train_length`` on the same inputs, the
    AHA gates straight-through from router scores."""
    n = cfg.train_length
    q, k, v = _qkv(cfg, 1, n, n, requires_grad=True)
    gate = _gate(cfg, pattern, 1, n, mu)
    scores = (gate.float() * 0.5 + 0.25).requires_grad_()  # s > 0.5 exactly where the gate is global
    up = torch.randn_like(q)

    def dense_step():
        torch.autograd.grad((F.scaled_dot_product_attention(q, k, v, is_causal=True) * up).sum(), [q, k, v])

    def aha_step():
        out = aha_attention_fast(q, k, v, straight_through(scores, 0.5), cfg.window)
        torch.autograd.grad((out * up).sum(), [q, k, v, scores])

    return gate, dense_step, aha_step


def bench_training(cfg: BenchConfig, pattern: str, mu: float) -> dict:
    n = cfg.train_length
    gate, dense_step, aha_step = training_steps(cfg, pattern, mu)
    dense_name, dense = fastest_dense(dense_step, cfg)
    aha = median_time(aha_step, cfg.repeats, device=cfg.device)
    # The PyTorch path, for comparison (the same as aha_ms where triton is missing).
    with use_backend("torch"):
        torch_path = median_time(aha_step, cfg.repeats, device=cfg.device)
    return {"n": n, "pattern": pattern, "mu_asked": mu, "mu_f": gate.float().mean().item(), "dense_backend": dense_name,
            "dense_ms": 1e3 * dense, "aha_ms": 1e3 * aha, "torch_path_ms": 1e3 * torch_path, "overhead": aha / dense}


def profile_cases(cfg: BenchConfig) -> dict:
    """{name: callable} of the paths ``bench_profile`` profiles, on the inputs the bench's own rows use."""
    pattern, mu = cfg.patterns[0], cfg.mus[0]
    n = max([x for x in cfg.prefill_lengths if x <= 32768] or [min(cfg.prefill_lengths)])
    t = max(cfg.decode_lengths)
    prefill, decode = prefill_inputs(cfg, n, pattern, mu), decode_inputs(cfg, t, pattern, mu)

    def attend(inputs):
        with torch.no_grad():
            aha_attention_fast(*inputs, cfg.window)

    return {f"prefill, B = 1, n = {n}": lambda: attend(prefill),
            f"decode, B = {cfg.decode_batch}, n = {t}": lambda: attend(decode),
            f"training forward + backward, B = 1, n = {cfg.train_length}": training_steps(cfg, pattern, mu)[2]}


def run_bench(cfg: BenchConfig, progress=print) -> dict:
    """The correctness check, then every prefill, decode and training row of ``cfg``; ``progress`` gets a
    line per row. The Triton kernels' launch settings are autotuned on the GPU (``allhere.kernels.autotune``:
    the first call of each shape class times a few; ``report["launch_settings"]`` lists what was chosen and
    what the tuning cost), or pinned with ``cfg.pin_tiles``."""
    with autotune.pinned() if cfg.pin_tiles else contextlib.nullcontext():
        report = _run_bench(cfg, progress)
    report["launch_settings"] = "pinned" if cfg.pin_tiles else autotune.choices()
    return report


def _run_bench(cfg: BenchConfig, progress) -> dict:
    report = {"config": dataclasses.asdict(cfg), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu"}
    report["aha_path"] = "Triton kernels" if cfg.device.startswith("cuda") and triton_available() else \
        "PyTorch path (no CUDA or no triton: pip install 'allhere[gpu]')"
    progress(f"AHA runs the {report['aha_path']}")
    if "model" in cfg.tables:  # first when asked for: the tables a user's runs reach
        from .llama_bench import run_llama_tables

        report["llama"] = run_llama_tables(cfg.llama, progress)
    if "ops" not in cfg.tables:
        return report
    report["check"] = check_paths(cfg)
    progress(f"check against the fp32 reference: {report['check']}")
    if cfg.profile:  # first: a few seconds, and what a missed goal needs even if the tables are cut short
        from .bench_profile import profile_paths

        report["profile"] = profile_paths(profile_cases(cfg), cfg.device, progress)
    if cfg.model_lengths:
        from .model_bench import run_model_bench

        report["model"] = run_model_bench(cfg.model_lengths, progress=progress)
    report["prefill"], report["decode"], report["training"] = [], [], []
    for pattern in cfg.patterns:
        for mu in cfg.mus:
            for n in cfg.prefill_lengths:
                report["prefill"].append(bench_prefill(cfg, n, pattern, mu))
                progress(f"prefill {report['prefill'][-1]}")
            for n in cfg.decode_lengths:
                report["decode"].append(bench_decode(cfg, n, pattern, mu))
                progress(f"decode {report['decode'][-1]}")
            report["training"].append(bench_training(cfg, pattern, mu))
            progress(f"training {report['training'][-1]}")
    return report


def _mu(row: dict) -> str:
    return f"{100 * row['mu_asked']:.0f}% ({100 * row['mu_f']:.1f}%)"


def _streamed_note(rows: list[dict]) -> list[str]:
    if not rows or "aha_stream_ms" not in rows[0]:
        return []
    return ["Times of one call, the GPU idle before it (what a lone call waits: the host's work, then the "
            "GPU's); \"back to back\": 20 calls issued in a row, per call (what a model's layers get when the "
            "host runs ahead); \"AHA's host\": the wall time per call until the 20th returned, before the GPU "
            "finished (its Python and launches).", ""]


def _head(columns: list[str], rows: list[dict]) -> list[str]:
    """A table's header and rule, with the back-to-back columns where the rows have them."""
    if rows and "aha_stream_ms" in rows[0]:
        columns = [*columns, "dense, back to back", "AHA, back to back", "speed-up, back to back", "AHA's host"]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _streamed(r: dict) -> str:
    if "aha_stream_ms" not in r:
        return ""
    return (f" {ms_text(r['dense_stream_ms'])} | {ms_text(r['aha_stream_ms'])} | {r['speedup_stream']:.2f}x "
            f"| {ms_text(r['aha_host_ms'])} |")


def render(report: dict) -> str:
    """bench.md: the whole-model tables (when run), the check and one table per part (prefill, decode,
    training)."""
    c = report["config"]
    out = [f"# AHA against dense attention ({report['device_name']}, torch {report['torch']})", ""]
    if report.get("llama"):
        from .llama_bench import render_llama

        out += [*render_llama(report["llama"]), ""]
    if "check" not in report:
        return "\n".join(out) + "\n"
    out += [f"The op: heads {c['heads']}, head dim {c['dim']}, w = {c['window']}; ratios against the fastest "
            f"dense SDPA backend of the same run. AHA runs the {report['aha_path']}.", "",
           "Check against the fp32 reference (relative error): "
           + ", ".join(f"{k} {v:.1e}" for k, v in report["check"].items()), "",
           "## Prefill (B = 1)", "", *_streamed_note(report["prefill"]),
           *_head(["n", "gates", "mu_f asked (drawn)", "dense (backend)", "Flex sliding", "AHA", "speed-up",
                   "FLOP limit"], report["prefill"])]
    for r in report["prefill"]:
        flex = "n/a" if r["flex_sliding_ms"] is None else f"{r['flex_sliding_ms']:.2f} ms"
        out.append(f"| {r['n']} | {r['pattern']} | {_mu(r)} | {r['dense_ms']:.2f} ms ({r['dense_backend']}) "
                   f"| {flex} | {r['aha_ms']:.2f} ms | {r['speedup']:.2f}x | {r['limit']:.1f}x |" + _streamed(r))
    out += ["", f"## Decode (B = {c['decode_batch']}, one query per sequence)", "",
            *_head(["n", "gates", "mu_f asked (drawn)", "dense (backend)", "AHA", "speed-up", "byte limit",
                    "AHA on a cache view (its buffer 4096 tokens longer)"], report["decode"])]
    for r in report["decode"]:
        out.append(f"| {r['n']} | {r['pattern']} | {_mu(r)} | {r['dense_ms']:.3f} ms ({r['dense_backend']}) "
                   f"| {r['aha_ms']:.3f} ms | {r['speedup']:.2f}x | {r['limit']:.1f}x "
                   f"| {ms_text(r['aha_cache_view_ms'])} ({r['aha_cache_view_ms'] / r['aha_ms']:.2f}x) |"
                   + _streamed(r))
    out += ["", "## Training forward + backward (B = 1)", "",
            "| n | gates | mu_f asked (drawn) | dense (backend) | AHA (STE) | AHA / dense | PyTorch path |",
            "|---|---|---|---|---|---|---|"]
    for r in report["training"]:
        out.append(f"| {r['n']} | {r['pattern']} | {_mu(r)} | {r['dense_ms']:.2f} ms ({r['dense_backend']}) "
                   f"| {r['aha_ms']:.2f} ms | {r['overhead']:.2f}x | {r['torch_path_ms']:.2f} ms |")
    if report.get("model"):
        from .model_bench import render_model

        out += ["", *render_model(report["model"])]
    if report.get("profile"):
        from .bench_profile import render_profile

        out += ["", *render_profile(report["profile"])]
    out += ["", *render_launch_settings(report.get("launch_settings"))]
    return "\n".join(out) + "\n"


def render_launch_settings(settings) -> list[str]:
    """The Triton kernels' launch settings of the run: pinned, or each autotuned choice with its cost."""
    if settings == "pinned":
        return ["## Launch settings", "", "Pinned (`--pin-tiles`): each kernel's first candidate this GPU runs."]
    if not settings:
        return []
    total = sum(c["tuning_s"] for c in settings)
    out = ["## Launch settings (autotuned on this GPU)", "",
           f"The first call of each shape class timed the candidates below: {total:.1f} s in all, spent once per "
           "GPU and triton version (kept in the settings file; 0 s where read from it).", "",
           "| kernel | shape class | chosen (tiles, warps, stages) | ms | timed | tuning s | from |",
           "|---|---|---|---|---|---|---|"]
    for c in settings:
        kernel, shape = c["id"].split("|")[2:4]
        out.append(f"| {kernel} | {shape} | {tuple(c['setting'].values())} | {c['ms']} | {c['tried']} "
                   f"| {c['tuning_s']} | {c['source']} |")
    return out


def write_bench(report: dict, out: str | Path) -> dict[str, Path]:
    """bench.json and bench.md in ``out``."""
    return write_report(out, "bench", report, render(report))
