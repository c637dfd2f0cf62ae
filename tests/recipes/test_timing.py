"""The benchmarks' timing helpers on the CPU, against a fake clock: what is called, in which order, and which
of the times comes back."""

import pytest

from allhere_recipes import timing


@pytest.fixture
def clock(monkeypatch):
    """A perf_counter that only moves when ``tick(seconds)`` is called (by the timed callables)."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def tick(seconds: float) -> None:
        now[0] += seconds

    return tick


def test_call_times_median_and_best_after_the_warmup(clock):
    durations = iter([9.0, 3.0, 1.0, 2.0, 9.0, 3.0, 1.0, 2.0, 9.0, 3.0, 1.0, 2.0])

    def fn():
        clock(next(durations))

    assert timing.call_times(fn, repeats=3, warmup=1) == [3.0, 1.0, 2.0]  # the first call (9 s) untimed
    assert timing.median_time(fn, repeats=3, warmup=1) == 2.0
    assert timing.best_time(fn, repeats=3, warmup=1) == 1.0


def test_timed_call_returns_the_result_and_its_seconds(clock):
    assert timing.timed_call(lambda: clock(0.5) or "out") == ("out", 0.5)


def test_round_robin_rotates_and_drops_the_warmup_rounds():
    order = []
    runs = {name: (lambda name=name: order.append(name) or len(order)) for name in "abc"}
    results = timing.round_robin(runs, rounds=2, warmup=1)
    assert "".join(order) == "abc" + "bca" + "cab"  # round r starts at the r-th name
    assert results == {"a": [6, 8], "b": [4, 9], "c": [5, 7]}


def test_round_robin_times(clock):
    seconds = {"slow": 2.0, "fast": 0.5}
    times = timing.round_robin_times({k: (lambda k=k: clock(seconds[k])) for k in seconds}, rounds=3)
    assert times == {"slow": [2.0] * 3, "fast": [0.5] * 3}
