"""The whole job's time left, over all the training runs an experiment plans (not only the one running).

Each run ("stdlib/aha", "recall/pretrain", ...) is planned with its steps and a cost per step: tokens per
step x (2 x parameters + 2 x layers x seq_len x d_model), the forward's multiply-adds of the matrices and of
causal attention. The time left is that of the running run at its own measured pace, plus the steps of the
runs still to come at the pace measured so far per unit of cost. It is an estimate: it leaves out the
evaluations between runs, and a mechanism's overhead shows only once it runs (AHA steps cost 1.2-3.5x a
plain step of the same model on 2 CPU cores). ``Job.bar`` is a progress-bar factory for ``train``
(``progress=job.bar``), whose bar shows ``job_left`` beside the run's own numbers; ``Job.seconds`` holds
each run's wall time when it is done.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from allhere.config import ModelConfig
from allhere.runtime.progress import duration
from allhere.runtime.progress import progress as progress_bar


def step_cost(model: ModelConfig, batch: int, seq_len: int) -> float:
    """Relative cost of one training step of ``model`` on ``batch`` sequences of ``seq_len`` tokens."""
    from allhere.model import Decoder

    with torch.device("meta"):
        params = sum(p.numel() for p in Decoder(model).parameters())
    return batch * seq_len * (2.0 * params + 2.0 * model.n_layers * seq_len * model.d_model)


def steps_done(ckpt: Path) -> int:
    """Steps a run's checkpoint already holds (the readable json copy beside it; 0 when there is none)."""
    try:
        return int(json.loads(Path(ckpt).with_suffix(".json").read_text()).get("step", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


class Job:
    """Runs planned as ``name -> (steps, cost per step)``, ``name`` being the run's progress label
    ("<task>/<run folder>"); the steps its checkpoint already holds are taken off by ``plan``."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.left: dict[str, int] = {}  # steps left per run
        self.cost: dict[str, float] = {}
        self.seconds: dict[str, float] = {}  # wall time of each run, once done
        self.spent, self.done_cost = 0.0, 0.0  # seconds and cost of the steps done in this process

    def plan(self, ckpt: Path, steps: int, cost: float) -> None:
        name = f"{Path(ckpt).parent.parent.name}/{Path(ckpt).parent.name}"  # the label ``train`` gives its bar
        self.plan_named(name, steps - steps_done(ckpt), cost)

    def plan_named(self, name: str, steps: int, cost: float) -> None:
        """Work other than a training run (an evaluation), its bar labelled ``name``: ``steps`` of ``cost``."""
        self.left[name] = max(0, steps)
        self.cost[name] = cost

    def time_left(self, running: str, pace: float | None) -> float | None:
        """Seconds left: ``running`` at ``pace`` s/step, the others at the measured seconds per cost."""
        if not self.done_cost:
            return None
        per_cost = self.spent / self.done_cost
        own = self.left.get(running, 0) * (pace if pace is not None else self.cost.get(running, 0) * per_cost)
        return own + sum(n * self.cost[k] * per_cost for k, n in self.left.items() if k != running)

    def bar(self, total: int, desc: str, initial: int = 0, enabled: bool = True):
        """A progress bar for ``train`` that also tells the job's time left."""
        return JobBar(self, progress_bar(total, desc, initial, enabled and self.enabled), desc)


class JobBar:
    def __init__(self, job: Job, inner, desc: str) -> None:
        self.job, self.inner, self.desc = job, inner, desc
        self.t0 = self.last = time.monotonic()
        self.steps, self.values = 0, {}

    def update(self, n: int = 1) -> None:
        now = time.monotonic()
        job = self.job
        if self.desc in job.cost:  # a bar the job did not plan (work only some resumptions do) counts nothing
            job.spent += now - self.last
            job.done_cost += n * job.cost[self.desc]
            job.left[self.desc] = max(0, job.left[self.desc] - n)
        self.last, self.steps = now, self.steps + n
        self.set_postfix(**self.values)  # the job's time left in the line this update may print
        self.inner.update(n)

    def set_postfix(self, **values) -> None:
        self.values = {k: v for k, v in values.items() if k != "job_left"}
        left = self.job.time_left(self.desc, (self.last - self.t0) / self.steps if self.steps else None)
        self.inner.set_postfix(**self.values, **({"job_left": duration(left)} if left is not None else {}))

    def close(self) -> None:
        if self.desc in self.job.left:
            self.job.left[self.desc] = 0
        self.job.seconds[self.desc] = round(time.monotonic() - self.t0, 1)
        self.inner.close()
