"""Median wall time of a callable, with CUDA events on a GPU and perf_counter on the CPU (for benchmarks)."""

from __future__ import annotations

import math
import statistics
import time

import torch


def median_time(fn, repeats: int = 5, warmup: int = 1, device: str = "cpu") -> float:
    """Seconds: the median of ``repeats`` calls after ``warmup`` calls (on CUDA, timed by events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stream_time(fn, calls: int = 20, device: str = "cpu") -> tuple[float, float] | None:
    """(seconds per call, host seconds per call) of ``calls`` calls issued back to back between two CUDA
    events (after one warm-up). The host issues the next call while the GPU runs the last, so the first is
    max(host, GPU) per call, where ``median_time`` (one call, the GPU idle before it) is about host + GPU for
    a call of small kernels. The second is the wall time until the last call returned, before waiting for
    the GPU: the host's own work per call (its Python, the ops' and kernels' launches), as long as the
    GPU's queue does not fill. None off CUDA (on the CPU both are the call's time)."""
    if not device.startswith("cuda"):
        return None
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / calls, host / calls


def ms_text(ms: float) -> str:
    """Milliseconds with three significant digits and no exponent ("0.215 ms", "27.1 ms", "2712 ms"): a
    GPU's fast paths take fractions of a millisecond, which a fixed one decimal would print as 0.0."""
    if not ms > 0:
        return f"{ms:.0f} ms"
    return f"{ms:.{max(0, 2 - math.floor(math.log10(ms)))}f} ms"
