"""A small FSDP2 training run: started by torchrun (the resume test kills one of its processes) or by
``dist_worker.launch``; the one-process run of the same settings is ``run`` called directly."""

import os
import sys
from pathlib import Path

from allhere.config import TrainConfig

import train_worker  # the same model and batches as the one-process resume test

CFG = TrainConfig(steps=20, batch_size=2, grad_accum=4, lr=3e-3, ckpt_every=2, log_every=1)
AAMOE_CFG = TrainConfig(steps=6, batch_size=2, grad_accum=2, lr=3e-3, ckpt_every=6, log_every=1)


def run(path, delay=0.0):
    return train_worker.run(path, delay, CFG)


def spawned(rank, world, tmp, path):
    return {"history": run(path)["history"]}


def spawned_aamoe(rank, world, tmp, path):
    return {"history": train_worker.run(path, cfg=AAMOE_CFG, model_fn=train_worker.aamoe_model)["history"]}


if __name__ == "__main__":  # under torchrun: python -m torch.distributed.run ... dist_train_worker.py PATH DELAY
    pids = Path(sys.argv[1]).parent / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    run(sys.argv[1], delay=float(sys.argv[2]))
    import torch.distributed as dist

    dist.destroy_process_group()
