"""Peak memory of loading a Hugging Face model: straight into FSDP2 shards on N processes
(``allhere.hf.sharded_load``) against one process loading the whole model (``allhere.hf.io.load_local``),
both in float32 (what ``allhere sft`` trains), both converted to AHA.

    python benchmarks/sharded_load.py --model path/to/model --nproc 4

Each load runs in fresh processes (gloo on the CPU); the peak is the rise of the resident memory during
the load (``allhere.hf.sharded_load.PeakRSS``: the kernel's high-water mark, reset first). Printed: per
rank, the peak, this rank's parameter bytes and the seconds; the whole model's bytes; the ratio of the
largest rank's peak to the one-process load's.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from gloo_ranks import launch  # benchmarks/gloo_ranks.py

MIB = 2 ** 20


def _sharded(rank: int, world: int, model: str, window: int) -> dict:
    from allhere.hf.sharded_load import load_sharded
    from allhere.mechanisms import AHAConfig

    _, m = load_sharded(model, mechanism=AHAConfig(window=window), dtype=torch.float32, measure_memory=True)
    r = m.allhere_load_report
    return dict(peak=r.peak_rss_delta_bytes, local=r.local_bytes, full=r.full_model_bytes, seconds=r.seconds,
                source=r.peak_source)


def _whole(rank: int, world: int, model: str, window: int) -> dict:
    from allhere.hf import convert
    from allhere.hf.io import load_local
    from allhere.hf.sharded_load import PeakRSS
    from allhere.mechanisms import AHAConfig

    start = time.perf_counter()
    with PeakRSS() as peak:
        _, m = load_local(model, convertible=True, dtype=torch.float32)
        convert(m, AHAConfig(window=window), seed=0)
    return dict(peak=peak.delta, seconds=time.perf_counter() - start, source=peak.source,
                full=sum(p.numel() * p.element_size() for p in m.parameters()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local Hugging Face causal LM folder")
    p.add_argument("--nproc", type=int, default=4, help="processes of the sharded load (default 4)")
    p.add_argument("--window", type=int, default=256, help="AHA's window (default 256)")
    args = p.parse_args(argv)
    print(f"# {platform.machine()}, torch {torch.__version__}, {os.cpu_count()} cores; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    (whole,) = launch(_whole, 1, args.model, args.window)  # a fresh process of its own
    ranks = launch(_sharded, args.nproc, args.model, args.window)
    print(f"model {args.model}: {whole['full'] / MIB:.1f} MiB of float32 parameters (AHA routers included)\n")
    print("| load | peak resident memory rise MiB | parameters held MiB | seconds | measured by |\n"
          "|---|---|---|---|---|")
    print(f"| one process, whole model (load_local) | {whole['peak'] / MIB:.1f} | {whole['full'] / MIB:.1f} | "
          f"{whole['seconds']:.1f} | {whole['source']} |")
    for r, res in enumerate(ranks):
        print(f"| sharded, rank {r} of {args.nproc} | {res['peak'] / MIB:.1f} | {res['local'] / MIB:.1f} | "
              f"{res['seconds']:.1f} | {res['source']} |")
    worst = max(res["peak"] for res in ranks)
    print(f"\nlargest rank's peak / one-process peak: {worst / whole['peak']:.3f}; / the whole model: "
          f"{worst / whole['full']:.3f}")
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
