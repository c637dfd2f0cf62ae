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
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 2 ** 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded(rank: int, world: int, port: int, model: str, window: int, out: str) -> None:
    from allhere.hf.sharded_load import load_sharded
    from allhere.mechanisms import AHAConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _, m = load_sharded(model, mechanism=AHAConfig(window=window), dtype=torch.float32)
        r = m.allhere_load_report
        torch.save(dict(peak=r.peak_rss_delta_bytes, local=r.local_bytes, full=r.full_model_bytes,
                        seconds=r.seconds, source=r.peak_source), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _whole(model: str, window: int, out: str) -> None:
    import time

    from allhere.hf import convert
    from allhere.hf.io import load_local
    from allhere.hf.sharded_load import PeakRSS
    from allhere.mechanisms import AHAConfig

    start = time.perf_counter()
    with PeakRSS() as peak:
        _, m = load_local(model, convertible=True, dtype=torch.float32)
        convert(m, AHAConfig(window=window), seed=0)
    torch.save(dict(peak=peak.delta, seconds=time.perf_counter() - start, source=peak.source,
                    full=sum(p.numel() * p.element_size() for p in m.parameters())), os.path.join(out, "whole.pt"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local Hugging Face causal LM folder")
    p.add_argument("--nproc", type=int, default=4, help="processes of the sharded load (default 4)")
    p.add_argument("--window", type=int, default=256, help="AHA's window (default 256)")
    args = p.parse_args(argv)
    print(f"# {platform.machine()}, torch {torch.__version__}, {os.cpu_count()} cores; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=_whole, args=(args.model, args.window, out))
        proc.start()
        proc.join()
        if proc.exitcode:
            sys.exit(f"the one-process load failed (exit code {proc.exitcode})")
        mp.spawn(_sharded, args=(args.nproc, _port(), args.model, args.window, out), nprocs=args.nproc, join=True)
        whole = torch.load(os.path.join(out, "whole.pt"))
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(args.nproc)]
    print(f"model {args.model}: {whole['full'] / MIB:.1f} MiB of float32 parameters (AHA routers included)\n")
    print("| load | peak resident memory rise MiB | parameters held MiB | seconds | measured by |\n|---|---|---|---|---|")
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
