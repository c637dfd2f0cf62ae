"""``allhere bench --profile``: where the time of each AHA path goes, op by op (on a GPU, kernel by kernel),
at the goals' shapes: prefill at the longest prefill length up to 32k, decode at the longest cache length,
training forward + backward at the training length; long-tailed gates at the first mu_f of the bench
(7%). torch.profiler over a few calls after a warm-up; the table sorted by the time spent in each op
itself (device time on a GPU, CPU time on the CPU)."""

from __future__ import annotations

import torch

from ..ops.aha import aha_attention_fast
from ..ops.ste import straight_through

CALLS = 3  # profiled calls per path, after one warm-up


def profile_cases(cfg, qkv, gate) -> dict:
    """{name: callable} of the paths to profile; ``qkv(b, lq, lk, requires_grad=False)`` and
    ``gate(b, lq)`` make the inputs as the bench makes them."""
    n = max([x for x in cfg.prefill_lengths if x <= 32768] or [min(cfg.prefill_lengths)])
    prefill_in = qkv(1, n, n), gate(1, n)
    t = max(cfg.decode_lengths)
    decode_in = qkv(cfg.decode_batch, 1, t), gate(cfg.decode_batch, 1)
    decode_in[1][:, 0] = True  # as the bench's decode rows: head 0 global
    m = cfg.train_length
    train_q = qkv(1, m, m, requires_grad=True)
    scores = (gate(1, m).float() * 0.5 + 0.25).requires_grad_()
    up = torch.randn_like(train_q[0])

    def prefill():
        with torch.no_grad():
            aha_attention_fast(*prefill_in[0], prefill_in[1], cfg.window)

    def decode():
        with torch.no_grad():
            aha_attention_fast(*decode_in[0], decode_in[1], cfg.window)

    def training():
        out = aha_attention_fast(*train_q, straight_through(scores, 0.5), cfg.window)
        torch.autograd.grad((out * up).sum(), [*train_q, scores])

    return {f"prefill, B = 1, n = {n}": prefill, f"decode, B = {cfg.decode_batch}, n = {t}": decode,
            f"training forward + backward, B = 1, n = {m}": training}


def profile_paths(cfg, qkv, gate, rows: int = 12) -> dict[str, str]:
    """{path: torch.profiler's table of its ``rows`` most expensive ops} for ``profile_cases``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = cfg.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    tables = {}
    for name, fn in profile_cases(cfg, qkv, gate).items():
        fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(CALLS):
                fn()
            if cuda:
                torch.cuda.synchronize()
        tables[name] = prof.key_averages().table(sort_by=sort, row_limit=rows)
    return tables


def render_profile(tables: dict[str, str]) -> list[str]:
    out = ["## Where the time goes", "",
           f"torch.profiler over {CALLS} calls of each path after a warm-up; long-tailed gates; sorted by the "
           "time in each op itself.", ""]
    for name, table in tables.items():
        out += [f"### {name}", "", "```", table.rstrip(), "```", ""]
    return out
