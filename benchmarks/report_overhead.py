"""What the TensorBoard report costs a training run: steps/s of the same small run with ``report_to="none"`` and
``report_to="tensorboard"``, the two alternating round by round (the order swapped every round), each a whole
``allhere.train.train`` call from a fresh model in a fresh folder (the writer's start and close included).

    python benchmarks/report_overhead.py                  # 40 steps, a log step every step (the most writing)
    python benchmarks/report_overhead.py --eval-every 20  # also the held-out numbers and the mu_f heatmap image

Prints the median steps/s of each and their ratio (tensorboard / none; the goal: >= 0.98), the same for the
process's CPU seconds per step (less sensitive to other processes on the machine than wall time, and it counts
the writer's own thread too), the time spent inside the report's calls as a share of the reporting runs' time,
and the machine's load average before and after (the CPU is shared: a load above the core count makes every
wall-time number noisier).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import allhere as ah
from allhere.config import TrainConfig
from allhere.eval import evaluate_lm
from allhere.runtime import reporting
from allhere.train import train

METHODS = ("__init__", "step", "log", "evaluation", "flush", "close")
IN_CALLS = dict.fromkeys(METHODS, 0.0)  # wall seconds spent inside each of the TensorBoard report's methods


def timed(name, fn):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            IN_CALLS[name] += time.perf_counter() - start

    return call


for _name in METHODS:
    setattr(reporting.TensorBoardReport, _name, timed(_name, getattr(reporting.TensorBoardReport, _name)))


def model() -> ah.Decoder:
    torch.manual_seed(0)
    return ah.Decoder(ah.ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                     mechanism=ah.AHAConfig(window=16, lam=0.01)))


def run(report: str, folder: Path, args) -> tuple[float, float, float]:
    """(steps per second, CPU seconds per step, wall seconds) of one whole training run."""
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch, lr=1e-3, log_every=args.log_every,
                      eval_every=args.eval_every, ckpt_every=args.steps)
    held_out = torch.randint(0, 256, (4, args.seq), generator=torch.Generator().manual_seed(1))
    net = model()
    start, cpu = time.perf_counter(), time.process_time()
    with reporting.report_to(report, say=lambda line: None):
        train(net, lambda step, micro, g: torch.randint(0, 256, (args.batch, args.seq), generator=g), cfg,
              folder / "checkpoint.safetensors", eval_fn=lambda m: evaluate_lm(m, held_out), progress=False)
    wall = time.perf_counter() - start
    return args.steps / wall, (time.process_time() - cpu) / args.steps, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--rounds", type=int, default=5, help="runs of each, alternating (default 5)")
    p.add_argument("--log-every", type=int, default=1, help="a log step every this many steps (default 1)")
    p.add_argument("--eval-every", type=int, default=0, help="an evaluation every this many steps (default 0: none)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    runs: dict[str, list[tuple[float, float, float]]] = {"none": [], "tensorboard": []}
    with tempfile.TemporaryDirectory() as tmp:
        run("tensorboard", Path(tmp) / "warmup", args)  # imports, first allocations
        IN_CALLS.update(dict.fromkeys(METHODS, 0.0))
        for r in range(args.rounds):
            order = ("none", "tensorboard") if r % 2 == 0 else ("tensorboard", "none")
            for report in order:
                runs[report].append(run(report, Path(tmp) / f"{report}-{r}", args))
        events = sorted(p.name for p in (Path(tmp) / "tensorboard-0" / "tensorboard").iterdir())
    rate = {k: statistics.median(x[0] for x in v) for k, v in runs.items()}
    cpu = {k: statistics.median(x[1] for x in v) for k, v in runs.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; {args.steps} steps "
          f"of {args.batch} x {args.seq} tokens, log every {args.log_every}, eval every {args.eval_every or 'never'}; "
          f"median of {args.rounds} runs each")
    for k in ("none", "tensorboard"):
        print(f"report {k + ':':13} {rate[k]:6.2f} steps/s, {1e3 * cpu[k]:6.1f} CPU ms/step  "
              f"(runs, steps/s: {', '.join(f'{x[0]:.2f}' for x in runs[k])})")
    print(f"ratio tensorboard / none: steps/s {rate['tensorboard'] / rate['none']:.3f} (goal >= 0.98), CPU time "
          f"per step {cpu['none'] / cpu['tensorboard']:.3f} (inverted: > 1 is faster)")
    share = sum(IN_CALLS.values()) / sum(x[2] for x in runs["tensorboard"])
    logs = args.rounds * -(-args.steps // args.log_every)
    per_run = {k: 1e3 * v / args.rounds for k, v in IN_CALLS.items()}
    print(f"inside the report's calls: {sum(per_run.values()):.1f} ms per run, {100 * share:.2f}% of the reporting "
          f"runs' wall time: opening the writer {per_run['__init__']:.1f} ms, closing it {per_run['close']:.1f} ms, "
          f"a log step {1e3 * IN_CALLS['log'] / logs:.2f} ms, evaluations {per_run['evaluation']:.1f} ms per run")
    print(f"event files of a run: {events}")
    print(f"load average (1, 5, 15 min): before {tuple(round(x, 2) for x in load_before)}, "
          f"after {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
