"""Progress of long work: a tqdm bar on a terminal; elsewhere (a log file, CI, a pipe) one plain line every
few percent with the elapsed time and an estimate of the time left, instead of a bar redrawn with
carriage returns that a log shows as one endless line."""

from __future__ import annotations

import sys
import time


def progress(total: int, desc: str, initial: int = 0, enabled: bool = True, every_percent: int = 5):
    """An object with ``update(n=1)``, ``set_postfix(**values)`` and ``close()`` for ``total`` steps."""
    if enabled and sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
    return LineProgress(total, desc, initial, every_percent, sys.stderr if enabled else None)


def duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class LineProgress:
    """One line per ``every_percent`` of the steps (and at the end) on ``stream`` (None: nothing printed).
    The estimate extrapolates the steps done in this process, not the resumed ones."""

    def __init__(self, total: int, desc: str, initial: int = 0, every_percent: int = 5, stream=None) -> None:
        self.total, self.desc, self.n, self.start_n = max(total, 1), desc, initial, initial
        self.step = max(1, self.total * every_percent // 100)
        self.next = (initial // self.step + 1) * self.step
        self.stream = stream
        self.postfix = ""
        self.t0 = time.monotonic()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.next or self.n >= self.total:
            self.next = (self.n // self.step + 1) * self.step
            self._line()

    def line(self) -> str:
        done = self.n - self.start_n
        elapsed = time.monotonic() - self.t0
        text = f"{self.desc}: {100 * self.n / self.total:.0f}% ({self.n}/{self.total}), {duration(elapsed)} elapsed"
        if 0 < done and self.n < self.total:
            text += f", about {duration(elapsed / done * (self.total - self.n))} left"
        return text + (f"; {self.postfix}" if self.postfix else "")

    def _line(self) -> None:
        if self.stream is not None:
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        pass
