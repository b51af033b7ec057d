"""A run's progress on stderr: a tqdm bar with an ETA on a terminal, a plain line otherwise.

tqdm comes with the `bench` extra. Without it, or when stderr is not a terminal (a log
file, CI), one line a second says the same: elapsed, sent, done, errors, in flight, req/s.
So does a terminal that reports no size (a pseudo-terminal nobody sized, as `docker run
-t` or `kubectl exec -t` may give): tqdm sizes its bar to the width less one, and at a
width of 0 it prints nothing at all.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol, TextIO


class _Result(Protocol):
    @property
    def ok(self) -> bool: ...


class Run(Protocol):
    """What the progress line reads of a run (loadgen's `Run` is one)."""

    @property
    def label(self) -> str: ...

    @property
    def started(self) -> float: ...

    @property
    def results(self) -> Sequence[_Result]: ...


def _tqdm() -> Any | None:
    try:
        return importlib.import_module("tqdm").tqdm
    except ImportError:
        return None


def terminal_width(stream: TextIO) -> int:
    """The columns of the terminal `stream` writes to; 0 if it is none or reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return 0


def want_bar(stream: TextIO, bar: bool | None) -> bool:
    """A bar when asked for (and tqdm is there), else when `stream` is a terminal with a
    width; plain lines otherwise."""
    if _tqdm() is None:
        return False
    if bar is not None:
        return bar
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and terminal_width(stream) > 1


def make_bar(total: float, desc: str, unit: str, stream: TextIO) -> Any:
    """A tqdm bar (it shows rate and ETA itself); the caller checked want_bar.

    It follows the terminal's width; asked for on a terminal that reports none, it takes
    $COLUMNS, else 120 columns, rather than tqdm's nothing."""
    tqdm = _tqdm()
    assert tqdm is not None
    isatty = getattr(stream, "isatty", None)
    if isatty and isatty() and terminal_width(stream) <= 1:
        columns = shutil.get_terminal_size(fallback=(120, 24)).columns
        return tqdm(total=total, desc=desc, unit=unit, file=stream, ncols=columns, leave=True)
    return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, leave=True)


class Progress:
    """Tracks one run: requests sent (set by the runner) and answered (the run's results)."""

    def __init__(
        self, run: Run, total: int, stream: TextIO | None = None, bar: bool | None = None
    ) -> None:
        self.run = run
        self.total = total
        self.sent = 0
        self.stream = stream or sys.stderr
        self.bar = want_bar(self.stream, bar)

    def counts(self) -> tuple[int, int]:
        results = self.run.results
        return len(results), sum(1 for r in results if not r.ok)

    async def loop(self, every: float = 1.0) -> None:
        """Report every `every` s until cancelled (the runner cancels it at the end)."""
        if self.bar:
            await self._bar(every)
        else:
            await self._lines(every)

    async def _bar(self, every: float) -> None:
        with make_bar(self.total, f"[{self.run.label}]", "req", self.stream) as bar:
            try:
                while True:
                    await asyncio.sleep(every)
                    self._update(bar)
            finally:  # cancelled at the end of the run: show where it ended
                self._update(bar)

    def _update(self, bar: Any) -> None:
        done, errors = self.counts()
        bar.update(done - bar.n)
        bar.set_postfix_str(
            f"sent {self.sent} errors {errors} in-flight {self.sent - done}", refresh=True
        )

    async def _lines(self, every: float) -> None:
        last_done, last_at = 0, time.perf_counter()
        while True:
            await asyncio.sleep(every)
            now = time.perf_counter()
            done, errors = self.counts()
            rate = (done - last_done) / max(1e-9, now - last_at)
            last_done, last_at = done, now
            print(
                f"[{self.run.label}] {now - self.run.started:6.1f}s sent {self.sent}/{self.total}"
                f" done {done} errors {errors} in-flight {self.sent - done} {rate:6.1f} req/s",
                file=self.stream,
                flush=True,
            )
