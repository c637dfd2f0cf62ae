"""Stopping a long run cleanly. While ``stop_signals()`` is active (``allhere.train.train`` holds it around
its loop), the first SIGINT (Ctrl-C) or SIGTERM only records itself: the loop finishes the optimizer step in
flight, writes a checkpoint and raises ``Interrupted``. The command line turns that into one line and exit
code 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process the signal
stopped. Signals reach Python's main thread only: elsewhere nothing is installed and a signal does what it
did before.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A run stopped by a signal. ``step`` of ``steps`` is the step saved in ``checkpoint``; ``step`` None:
    stopped at once (a second signal, or one outside a training loop), nothing new was saved."""

    def __init__(self, signum: int, step: int | None = None, steps: int | None = None, checkpoint=None,
                 again: bool = False) -> None:
        self.signum, self.step, self.steps, self.checkpoint = signum, step, steps, checkpoint
        if step is not None:
            text = f"interrupted at step {step} of {steps} (saved to {checkpoint})"
        elif again:
            text = "interrupted again: stopped at once, the step in flight is lost (the last checkpoint is intact)"
        else:
            text = "interrupted"
        super().__init__(text)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """What the training loop reads after each step: ``signum``, the first SIGINT / SIGTERM received, or None."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.aborting = False


@contextlib.contextmanager
def stop_signals():
    """Turn SIGINT and SIGTERM into a ``StopRequest`` for the duration; restore the previous handlers after.

    A second signal raises ``Interrupted`` at once, wherever the loop is: whoever presses Ctrl-C twice wants
    out now, even in the middle of a long checkpoint write. That corrupts nothing: checkpoints are written to
    a temporary file and renamed (``allhere.runtime.model_checkpoint.atomic_write``; the sharded ones switch
    ``latest.json`` last), so an aborted write leaves the previous checkpoint in place. Under torchrun a rank
    stopped at once leaves the others waiting in a collective until torchrun ends them. A signal ignored when
    the run started (SIG_IGN, e.g. SIGINT of a background job) stays ignored.
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        if request.signum is None:  # the first: stop after the step in flight
            request.signum = signum
        elif not request.aborting:  # the second: stop now (a third one finds us on the way out already)
            request.aborting = True
            raise Interrupted(signum, again=True)

    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s, old in previous.items():
        if old is not signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield request
    finally:
        for s, old in previous.items():  # None: a handler not set from Python; the default is the closest
            signal.signal(s, signal.SIG_DFL if old is None else old)


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raises ``Interrupted`` (as SIGINT raises KeyboardInterrupt) for the duration, so that a run
    terminated outside its training loop (loading, evaluating) still ends in one line, not a silent death.
    Only where SIGTERM has its default action and in the main thread."""
    main_thread = threading.current_thread() is threading.main_thread()
    if not main_thread or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
