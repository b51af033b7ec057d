"""Shutdown, in one place: whether the gateway is draining, whether it is ending what still
runs, and the requests in progress (uvicorn's `ServerState` and `Server.should_exit` /
`force_exit` are the model).

    serving --first stop signal--> draining --drain_timeout, or a second signal--> aborting
            (readiness 503)                  (in-progress requests are cancelled; each
                                              answers 503 or ends its stream in-band)

The server (process/serve.py) moves the state on; the proxy registers each request's task and
reads `aborting` when it is cancelled, to tell our drain deadline from a client that left;
`/readyz` reads `draining`. Nothing else keeps a shutdown flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ABORT_GRACE = 2.0  # seconds the cancelled requests get to write their last words


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False  # readiness answers 503; everything is still served
        self.aborting = False  # the drain is over: requests still running are being ended
        self.stopping = asyncio.Event()  # the first stop signal arrived
        self.forced = asyncio.Event()  # a second one did: skip what is left of the drain
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_abort: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        state = "aborting" if self.aborting else "draining" if self.draining else "serving"
        forced = " forced" if self.forced.is_set() else ""
        return f"<Lifecycle {state}{forced} requests={len(self._tasks)}>"

    @property
    def in_progress(self) -> int:
        return len(self._tasks)

    # ------------------------------------------------------------ signals

    def stop(self) -> None:
        """A stop signal: the first starts the drain, the second forces it to end now."""
        if self.stopping.is_set():
            self.forced.set()
        self.stopping.set()

    @contextlib.contextmanager
    def signals(self, on_hup: Callable[[], None] | None = None) -> Iterator[None]:
        """SIGINT and SIGTERM call `stop` (and SIGHUP `on_hup`) while inside; on leaving, the
        handlers that were there before are back, so an embedding program keeps its own."""
        loop = asyncio.get_running_loop()
        wanted: dict[int, Callable[[], None]] = {sig: self.stop for sig in _STOP_SIGNALS}
        hup = getattr(signal, "SIGHUP", None)  # absent on Windows
        if hup is not None and on_hup is not None:
            wanted[hup] = on_hup
        installed: dict[int, Any] = {}
        for sig, callback in wanted.items():
            previous = signal.getsignal(sig)
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, callback)
                installed[sig] = previous
        try:
            yield
        finally:
            for sig, previous in installed.items():
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)
                    if previous is not None:  # None: set outside Python, nothing to put back
                        signal.signal(sig, previous)

    # ------------------------------------------------------------ requests

    def track(self, task: asyncio.Task[Any]) -> None:
        """A request started on `task`: the drain waits for it, and an abort cancels it."""
        self._tasks.add(task)
        self._idle.clear()

    def done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()

    def on_abort(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the abort starts (before any request is cancelled)."""
        self._on_abort.append(callback)

    async def drain(self, timeout: float) -> int:
        """Let requests in progress finish for up to `timeout` s (less if forced), then end
        the rest. Returns how many had to be ended."""
        waiting = asyncio.ensure_future(self._idle.wait())
        forced = asyncio.ensure_future(self.forced.wait())
        try:
            await asyncio.wait({waiting, forced}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            waiting.cancel()
            forced.cancel()
        return await self.abort()

    async def abort(self) -> int:
        """Cancel every request still in progress and give them a moment to answer.

        A cancelled request sees `aborting` and answers (503, or an in-band error event on
        a stream) instead of acting as if its client had left.
        """
        left = len(self._tasks)
        if not left:
            return 0
        self.aborting = True
        for callback in self._on_abort:
            callback()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_ABORT_GRACE):
                await self._idle.wait()
        return left
