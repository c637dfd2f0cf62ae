"""AHA fine-tuned towards a share of full attention (``TrainConfig.target_mu_f``) on the demo's tasks.

    python benchmarks/target_mu_f.py [--run runs/demo] [--task stdlib] [--targets 0.03 0.15] [--rate 0.05]

Reuses the demo's pretrained model of ``--run`` (pretrains it when missing, as ``allhere demo`` would) and
fine-tunes AHA with the demo's settings except that lambda is trained towards each target; each model goes
to ``<run>/<task>/target-mu-f-<target>-rate-<rate>/``. Prints, per target, the held-out evaluation and lambda and mu_f
along the training steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from allhere.runtime.model_checkpoint import read_checkpoint
from allhere_recipes.plans import TASKS, plans
from allhere_recipes.tasks import finetune, start_task


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/demo", help="the demo's run folder (default runs/demo)")
    p.add_argument("--task", choices=TASKS, default="stdlib")
    p.add_argument("--preset", default="cpu", help="the demo preset the run was made with (default cpu)")
    p.add_argument("--targets", type=float, nargs="+", default=[0.03, 0.15])
    p.add_argument("--rate", type=float, default=0.05, help="TrainConfig.lam_rate (default 0.05)")
    args = p.parse_args(argv)
    plan = plans(args.preset)[args.task]
    task = start_task(args.run, args.task, plan, None, progress=False)
    for target in args.targets:
        t0 = time.time()
        cfg = dataclasses.replace(plan.finetune, target_mu_f=target, lam_rate=args.rate, log_every=10)
        ckpt = task.run / f"target-mu-f-{target}-rate-{args.rate}" / "checkpoint.safetensors"
        model, _ = finetune(task, ckpt, plan.aha, False, cfg=cfg, periodic=False)
        result = {k: round(v, 4) for k, v in task.data.evaluate(model).items() if isinstance(v, float)}
        history = read_checkpoint(ckpt)[1]["history"]
        print(f"{args.task}, target mu_f {target}, lam_rate {args.rate} ({time.time() - t0:.0f} s): {result}")
        print("  step, training mu_f, lambda:", [(h["step"], round(h["mu_f"], 3), h["lam"]) for h in history[::2]])


if __name__ == "__main__":
    main()
