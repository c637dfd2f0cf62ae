"""``allhere bench --profile``: where the time of each AHA path goes, op by op (on a GPU, kernel by kernel),
at the goals' shapes: prefill at the longest prefill length up to 32k, decode at the longest cache length,
training forward + backward at the training length; the bench's first gate pattern and mu_f (long-tailed,
7%). torch.profiler over a few calls after a warm-up; the table sorted by the time spent in each op
itself (device time on a GPU, CPU time on the CPU)."""

from __future__ import annotations

import torch

CALLS = 3  # profiled calls per path, after one warm-up


def profile_paths(cases: dict, device: str, progress=print, rows: int = 12) -> dict[str, str]:
    """{path: torch.profiler's table of its ``rows`` most expensive ops} for ``cases`` ({name: callable}, the
    bench's ``profile_cases``) on ``device``; each table goes to ``progress`` as it is made."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    tables = {}
    for name, fn in cases.items():
        fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(CALLS):
                fn()
            if cuda:
                torch.cuda.synchronize()
        tables[name] = prof.key_averages().table(sort_by=sort, row_limit=rows)
        progress(f"profile of {name}:\n{tables[name]}")
    return tables


def render_profile(tables: dict[str, str]) -> list[str]:
    out = ["## Where the time goes", "",
           f"torch.profiler over {CALLS} calls of each path after a warm-up; the bench's first gate pattern and "
           "mu_f; sorted by the time in each op itself.", ""]
    for name, table in tables.items():
        out += [f"### {name}", "", "```", table.rstrip(), "```", ""]
    return out
