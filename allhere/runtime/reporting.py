"""Training curves for TensorBoard: a training run (``allhere.train.train``) writes TensorBoard event files
beside its checkpoint with torch's own ``torch.utils.tensorboard.SummaryWriter``.

What a run writes (tags):
  - at every log step (``TrainConfig.log_every``): ``train/loss`` (L_LM + lambda L_reg), ``train/lm_loss``,
    ``train/mu_f``, ``train/lambda`` (the one the step trained with), ``train/lr`` (the peak group's; routers
    train at lr * router_lr_mult) and ``train/tokens_per_s`` (the steps' tokens over their training time since
    the last log step; evaluations and checkpoints not counted);
  - at every evaluation of the loop (``eval_fn``, every ``TrainConfig.eval_every`` steps): ``eval/<name>`` for
    each number it returns, and ``eval/mu_f_heatmap``, an image of mu_f per (layer, head), where it returns
    one (``usage``, as ``allhere.eval.evaluate_lm`` does for a routed model). The image needs matplotlib
    (``pip install 'allhere[plot]'``); without it the image is skipped and a note says so, once;
  - after the run, where a job measures the model it saved on held-out data (``report_heldout``): ``heldout/<name>``
    for each number and ``heldout/mu_f_heatmap`` at the run's last step, in an events file of their own.

Where: ``<checkpoint's folder>/tensorboard/`` for a checkpoint named ``checkpoint.safetensors``, else
``<checkpoint's folder>/tensorboard/<its stem>/`` (DAR's two stages, ``stage1`` and ``stage2``, in one folder).
``tensorboard --logdir <folder above the runs>`` shows every run under it, one curve each.

Resume: the writer opens with ``purge_step`` = the checkpoint's step + 1, so TensorBoard drops whatever a
stopped run wrote after its last checkpoint and the resumed run writes those steps again: every step once.
The events are flushed at every checkpoint and when the run ends or stops; in between, the log steps' numbers
reach the writer in batches (at the first log step 10 s after the last batch) and the writer writes its file
every 120 s (torch's default).

The choice is an argument of ``train`` (``report_to="tensorboard"`` or ``"none"``), or a context manager
around any code (the command line's ``--report-to``); without either nothing is written:

    with allhere.runtime.reporting.report_to("tensorboard", root="runs/x"):
        allhere.hf.sft(model, data, "runs/x", window=64)    # every run in the block writes its events

tensorboard is optional (``pip install 'allhere[tensorboard]'``) and imported only where a writer is opened.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..validation import ConfigError

REPORT_TO = ("tensorboard", "none")
INSTALL = "pip install 'allhere[tensorboard]'"


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def default_report_to() -> str:
    """The command line's default: "tensorboard" where the tensorboard package is installed, else "none"."""
    return "tensorboard" if tensorboard_installed() else "none"


def check_report_to(name: str) -> str:
    """``name`` if it is a known report (ConfigError otherwise) that can be written here (ImportError naming
    the extra to install otherwise)."""
    if name not in REPORT_TO:
        raise ConfigError(f"report_to must be one of {', '.join(REPORT_TO)}; got {name!r}")
    if name == "tensorboard" and not tensorboard_installed():
        raise ImportError(f"TensorBoard reports need the tensorboard package: {INSTALL}")
    return name


def events_dir(ckpt_path: str | Path) -> Path:
    """Where the run checkpointed at ``ckpt_path`` writes its events (see the module docstring)."""
    ckpt_path = Path(ckpt_path)
    folder = ckpt_path.parent / "tensorboard"
    return folder if ckpt_path.stem == "checkpoint" else folder / ckpt_path.stem


EVENTS_PREFIX = "events.out.tfevents."  # how TensorBoard's writers name their files


def stale_events(run: str | Path) -> Path | None:
    """``run/tensorboard`` when it is all ``run`` holds beside a run lock, and it holds TensorBoard event files
    only: what a training run killed before its first checkpoint leaves (a new run there replaces them); None
    otherwise."""
    from .runlock import LOCK_NAME

    run = Path(run)
    folder = run / "tensorboard"
    if not folder.is_dir() or folder.is_symlink() or any(f.name not in (LOCK_NAME, folder.name) for f in run.iterdir()):
        return None
    for root, dirs, files in os.walk(folder):
        if any(os.path.islink(os.path.join(root, d)) for d in dirs):
            return None
        if any(not f.startswith(EVENTS_PREFIX) or os.path.islink(os.path.join(root, f)) for f in files):
            return None
    return folder


def say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Reporting:
    """The report chosen for a block of code (``report_to``)."""

    name: str  # "tensorboard" or "none"
    root: Path | None = None  # the folder the block's runs write under (for the `tensorboard --logdir` line)
    say: Callable[[str], None] = say_on_stderr  # where the one line about the events goes
    said: set = field(default_factory=set)  # what was said already (each thing once per block)

    def once(self, key: str, line: str) -> None:
        if key not in self.said:
            self.said.add(key)
            self.say(line)


_current: contextvars.ContextVar[Reporting | None] = contextvars.ContextVar("allhere_report", default=None)


@contextlib.contextmanager
def report_to(name: str | None = None, root: str | Path | None = None, say: Callable[[str], None] = say_on_stderr):
    """Every training run in the block reports to ``name`` ("tensorboard" or "none"; None: tensorboard where
    it is installed). The first run that opens a writer says where the events go and how to see them (one
    line to ``say``), naming ``root`` for ``tensorboard --logdir`` (default: that run's events folder)."""
    choice = Reporting(check_report_to(default_report_to() if name is None else name),
                       None if root is None else Path(root), say)
    token = _current.set(choice)
    try:
        yield choice
    finally:
        _current.reset(token)


class NoReport:
    """A run that reports nothing: every call does nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, tokens: float, seconds: float) -> None:
        """One optimizer step done: its ``tokens`` in ``seconds`` of training."""

    def log(self, step: int, sums: dict, lam: float, lr: float) -> None:
        """A log step: the step's summed ``loss``, ``lm`` and ``mu_f``, its lambda and learning rate."""

    def evaluation(self, step: int, result: dict, model=None, prefix: str = "eval") -> None:
        """An evaluation's numbers (and its ``usage`` [routed layers][heads] of ``model``, drawn as the mu_f
        heatmap), tagged ``<prefix>/...``."""

    def flush(self) -> None:
        """Everything so far on disk (called at each checkpoint)."""

    def close(self) -> None:
        pass


class TensorBoardReport(NoReport):
    """A run's events in ``logdir``, continuing a run stopped after ``start_step`` (see the module docstring).

    The log steps' scalars are handed to the ``SummaryWriter`` (with the time they were logged at) in batches:
    at most every ``HAND_OVER_SECONDS``, at each evaluation, checkpoint and at the end. Each ``add_scalar`` wakes
    the writer's thread, and the training loop can then wait up to a GIL switch interval (5 ms) for the CPU: six
    scalars a log step cost a short step a few percent (``benchmarks/report_overhead.py``); a batch wakes it once.
    The writer writes its file every 120 s anyway, so nothing shows up later than it would.
    """

    HAND_OVER_SECONDS = 10.0

    def __init__(self, logdir: Path, start_step: int, note: Callable[[str, str], None], suffix: str = "") -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a reader drops the events of steps >= start_step + 1 written before this writer opened;
        # max_queue: a batch is handed over without waiting for the writer's thread (the default, 10, would);
        # suffix: the end of the file's name
        self.writer = SummaryWriter(str(logdir), purge_step=start_step + 1, max_queue=1000, filename_suffix=suffix)
        self.note = note
        self.tokens = self.seconds = 0.0
        self.pending: list[tuple[str, float, int, float]] = []  # (tag, value, step, wall time) not handed over yet
        self.handed = time.monotonic()
        self.failed = False  # the events could not be written (their folder gone, the disk full): training goes on

    def guarded(self, write: Callable[[], None]) -> None:
        """``write()`` unless writing failed before; an OSError (the writer's thread raises its own at the next
        call) is said once and ends the events, never the training run."""
        if self.failed:
            return
        try:
            write()
        except OSError as e:
            self.failed = True
            self.note("failed", f"TensorBoard: events no longer written ({e}); the training run goes on")

    def add(self, tag: str, value: float, step: int) -> None:
        self.pending.append((tag, float(value), step, time.time()))

    def hand_over(self) -> None:
        pending, self.pending = self.pending, []
        self.handed = time.monotonic()

        def write() -> None:
            for tag, value, step, walltime in pending:
                self.writer.add_scalar(tag, value, step, walltime=walltime)

        self.guarded(write)

    def step(self, tokens: float, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def log(self, step: int, sums: dict, lam: float, lr: float) -> None:
        for key, tag in (("loss", "loss"), ("lm", "lm_loss"), ("mu_f", "mu_f")):
            self.add(f"train/{tag}", sums[key], step)
        self.add("train/lambda", lam, step)
        self.add("train/lr", lr, step)
        if self.seconds > 0:
            self.add("train/tokens_per_s", self.tokens / self.seconds, step)
        self.tokens = self.seconds = 0.0
        if time.monotonic() - self.handed >= self.HAND_OVER_SECONDS:
            self.hand_over()

    def evaluation(self, step: int, result: dict, model=None, prefix: str = "eval") -> None:
        for key, value in result.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.add(f"{prefix}/{key}", value, step)
        self.hand_over()
        if result.get("usage"):
            self.heatmap(step, result["usage"], model, f"{prefix}/mu_f_heatmap")

    def heatmap(self, step: int, usage: list, model, tag: str = "eval/mu_f_heatmap") -> None:
        from ..analysis.plots import usage_figure
        from ..routing import routed_layers

        title = f"mu_f per layer and head, step {step}"
        layers = [i for i, _ in routed_layers(model)] if model is not None else []
        try:
            fig = usage_figure({title: usage}, {title: layers} if len(layers) == len(usage) else None)
        except ImportError as e:  # no matplotlib: the numbers are there, the picture is not
            self.note("heatmap", f"TensorBoard: no mu_f heatmap images ({e})")
            return
        fig.set_layout_engine("constrained")  # add_figure draws the canvas as it is: labels and colour bar inside
        self.guarded(lambda: self.writer.add_figure(tag, fig, step))  # closes the figure

    def flush(self) -> None:
        self.hand_over()
        self.guarded(self.writer.flush)

    def close(self) -> None:
        self.hand_over()
        self.guarded(self.writer.close)


def open_report(report: str | None, ckpt_path: str | Path, start_step: int, steps: int,
                writes: bool = True) -> NoReport:
    """The report of a run checkpointed at ``ckpt_path`` that goes on from ``start_step`` to ``steps``:
    ``report`` ("tensorboard", "none"; None: the innermost ``report_to`` block's choice, else "none").
    Nothing is opened for a run with no step left, or where this process does not write (``writes``: False on
    every rank but the first under torchrun)."""
    choice = _current.get()
    name = check_report_to(report if report is not None else choice.name if choice is not None else "none")
    if name == "none" or not writes or start_step >= steps:
        return NoReport()
    choice = choice or Reporting(name)
    logdir = events_dir(ckpt_path)
    opened = TensorBoardReport(logdir, start_step, choice.once)
    root = choice.root or logdir
    choice.once("where", f"TensorBoard: training curves in {logdir} (each training run in its folder's tensorboard/); "
                         f"see them with: tensorboard --logdir {root}")
    return opened


HELDOUT_SUFFIX = ".heldout"  # the end of the name of a run's held-out events file (``report_heldout``)


def report_heldout(ckpt_path: str | Path, step: int, result: dict, model=None, report: str | None = None) -> None:
    """A job's held-out evaluation of the model that the run checkpointed at ``ckpt_path`` trained (``result``: its
    numbers and ``usage``, as an evaluation of the loop returns them; ``model``: for the heatmap's layer numbers),
    added to the run's events at ``step`` (its last) as ``heldout/<name>`` and ``heldout/mu_f_heatmap``: what the
    job measured once the run was done, beside its curves, with no pass of its own. The events go into one file of
    their own, which replaces the one an earlier call wrote (a resumed job writes each number once). ``report`` as
    ``open_report``'s."""
    choice = _current.get()
    name = check_report_to(report if report is not None else choice.name if choice is not None else "none")
    if name == "none":
        return
    logdir = events_dir(ckpt_path)
    old = sorted(logdir.glob(f"{EVENTS_PREFIX}*{HELDOUT_SUFFIX}")) if logdir.is_dir() else []
    with TensorBoardReport(logdir, step, (choice or Reporting(name)).once, suffix=HELDOUT_SUFFIX) as opened:
        opened.evaluation(step, result, model, prefix="heldout")
    for path in old:
        path.unlink(missing_ok=True)
    for path in set(logdir.glob(f"{EVENTS_PREFIX}*{HELDOUT_SUFFIX}")) - set(old):
        _sort_last(path)


def _stamp(path: Path) -> int | None:
    """The second an events file was opened, as its name says (``events.out.tfevents.<10 digits>.<host>...``)."""
    head = path.name[len(EVENTS_PREFIX):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _sort_last(path: Path) -> None:
    """Rename the events file ``path`` so that its name sorts after every other events file of its folder.
    TensorBoard reads a run's files in the order of their names, and where a later file holds an earlier step
    than one already read, it drops what was read at that step and after: held-out numbers at a run's last step,
    read before the run's own file, would vanish. Names start with the second the file was opened (ten digits),
    then the host, the process and a counter of writers, so a file opened in the same second as the run's may sort
    first ("10" before "9"); its name takes the second after the newest of them instead."""
    others = [p for p in path.parent.glob(f"{EVENTS_PREFIX}*") if p != path]
    if not others or max(p.name for p in others) < path.name:
        return
    stamps = [s for s in map(_stamp, others) if s is not None]
    own = _stamp(path)
    if own is None or not stamps:
        return
    rest = path.name[len(EVENTS_PREFIX):].split(".", 1)[1]
    path.rename(path.with_name(f"{EVENTS_PREFIX}{max(stamps) + 1:010d}.{rest}"))
