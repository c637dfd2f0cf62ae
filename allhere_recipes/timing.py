"""Timing for benchmarks: a callable's median or fastest time (CUDA events on a GPU, perf_counter on the
CPU), one call's wall time, and configurations timed round-robin."""

from __future__ import annotations

import math
import statistics
import time

import torch


def call_times(fn, repeats: int = 5, warmup: int = 1, device: str = "cpu") -> list[float]:
    """Seconds of each of ``repeats`` calls after ``warmup`` calls (on CUDA, timed by events)."""
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
    return times


def median_time(fn, repeats: int = 5, warmup: int = 1, device: str = "cpu") -> float:
    """Seconds: the median of ``repeats`` calls after ``warmup`` calls (on CUDA, timed by events)."""
    return statistics.median(call_times(fn, repeats, warmup, device))


def best_time(fn, repeats: int = 5, warmup: int = 1, device: str = "cpu") -> float:
    """Seconds: the fastest of ``repeats`` calls after ``warmup`` calls (on CUDA, timed by events)."""
    return min(call_times(fn, repeats, warmup, device))


def timed_call(fn, device: str = "cpu"):
    """(what ``fn()`` returned, the call's wall seconds by perf_counter); on CUDA the device is synchronised
    before and after the call, so that the time is the call's work, queued on the GPU included."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def round_robin(runs: dict, rounds: int, warmup: int = 0) -> dict:
    """runs: name -> callable; every name called once per round, the order rotating one place each round
    (round r starts at the r-th name), so that a slow spell of a shared machine falls on every name alike.
    Returns name -> what its callable returned in each round after the first ``warmup`` rounds."""
    names = list(runs)
    results = {n: [] for n in names}
    for r in range(warmup + rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out = runs[n]()
            if r >= warmup:
                results[n].append(out)
    return results


def round_robin_times(calls: dict, rounds: int, warmup: int = 0) -> dict:
    """name -> wall seconds (perf_counter, no synchronisation: for the CPU) of each of its calls in the timed
    rounds of ``round_robin``."""
    return round_robin({n: (lambda fn=fn: timed_call(fn)[1]) for n, fn in calls.items()}, rounds, warmup)


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
