"""How every committed stream is relayed: below asyncio's streams, socket to socket.

Once the first event has gone out, `Splice` is the `Sink` (upstream/connection.py) of the
instance's answer: each body chunk arrives in the upstream connection's `data_received`,
goes through the SSE framer (`sse.Framer`: whole events only, counted), and is handed to
the client's stream (`Client`: client_stream.py's `ClientStream`, the one writer of the
answer, which frames, counts and writes it at once), with no await per chunk. The relay's
coroutine awaits `done` once, for the whole stream.

Flow control both ways (uvicorn's `flow_control.py` is the model): when the client's
write buffer passes its high-water mark, the client connection (connections.py) says so
and the upstream socket stops being read, so the instance's own sends wait; below the
low-water mark reading resumes. A client that stays behind for `write_timeout` is let go.
The silence clock (no data event for `silence` seconds) is one timer for the stream,
re-armed from the last event's time only when it fires, and stopped while the client is
behind. What ends the stream is `done`'s result, an `End`; the relay writes the in-band
error, `[DONE]` and the final chunk itself, through the same client stream.
"""

from __future__ import annotations

import asyncio
import enum
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.relay import sse

Decode = Callable[[bytes], bytes]


class Why(enum.Enum):
    ENDED = "ended"  # the instance's answer ended (cleanly or broken: see End.broken)
    QUIET = "quiet"  # no data event for `silence` seconds
    CLIENT = "client"  # the client left, or stayed behind for `write_timeout`


@dataclass(frozen=True)
class End:
    why: Why
    broken: str | None = None  # with ENDED: why the instance's stream is unusable, if it is


class Source(Protocol):
    """The instance's answer (connection.py's `Response`): its body pushed to a sink, its
    reads paused."""

    def splice(self, sink: Splice) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Client(Protocol):
    """The client's side of the stream (client_stream.py's `ClientStream`)."""

    def send(self, data: bytes) -> bool:
        """Write `data` now, framed as the answer is; False if the client is gone."""
        ...


class Watch(Protocol):
    """The client's connection: tells a listener when its write buffer is over the mark."""

    def watch_writing(self, listener: Callable[[bool], None] | None) -> bool: ...


# After `data: [DONE]` the answer is whole and only its framing (the last chunk) may still
# come: this long, then the client's stream ends anyway and the connection is dropped.
DONE_GRACE_S = 0.2


class Splice:
    """Relays one stream's events from the instance to the client as they arrive."""

    __slots__ = (
        "_loop",
        "_quiet",
        "_slow",
        "behind",
        "client",
        "decode",
        "done",
        "framer",
        "last_event",
        "silence",
        "source",
        "write_timeout",
    )

    def __init__(
        self,
        source: Source,
        client: Client,
        framer: sse.Framer,
        *,
        silence: float,
        write_timeout: float,
        decode: Decode | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.source = source
        self.client = client
        self.framer = framer
        self.silence = silence
        self.write_timeout = write_timeout
        self.decode = decode
        self.done: asyncio.Future[End] = self._loop.create_future()
        self.behind = False  # the client's buffer is over its high-water mark
        self.last_event = self._loop.time()
        self._quiet: asyncio.TimerHandle | None = None
        self._slow: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        state = self.done.result().why.value if self.done.done() else "running"
        return f"<Splice {state} events={self.framer.events} behind={self.behind}>"

    def start(self, watch: Watch) -> None:
        """Start taking the source's chunks; `watch` reports the client's buffer."""
        self._quiet = self._loop.call_at(self.last_event + self.silence, self._check_quiet)
        if self.framer.done:  # it came with the first event, before the splice
            self._grace()
        if watch.watch_writing(self.writing):
            self.writing(False)
        self.source.splice(self)

    def stop(self, watch: Watch) -> None:
        """Stop the timers and the client's reports (idempotent); `done` is left as it is."""
        watch.watch_writing(None)
        self._cancel_timers()

    # ------------------------------------------------------------ connection.Sink

    def body(self, data: bytes) -> None:
        if self.done.done():
            return
        if self.decode is not None:
            try:
                data = self.decode(data)
            except zlib.error:
                self._end(End(Why.ENDED, "sent stream bytes that do not decode"))
                return
        framer = self.framer
        events = framer.events
        out = framer.feed(data)
        if framer.events != events:
            self.last_event = self._loop.time()
        if out and not self.client.send(out):
            self._end(End(Why.CLIENT))
            return
        if framer.done and self.silence > DONE_GRACE_S:
            self._grace()

    def _grace(self) -> None:
        """[DONE] came: what is left is framing, for DONE_GRACE_S at most. A body whose
        framing outlasts it (a Content-Length too large, no framing on a kept-alive answer)
        must not keep the client reading until the silence timeout."""
        self.silence = DONE_GRACE_S
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = self._loop.call_later(DONE_GRACE_S, self._check_quiet)

    def ended(self, broken: str | None) -> None:
        self._end(End(Why.ENDED, broken))

    # ------------------------------------------------------------ flow control

    def writing(self, ok: bool) -> None:
        """The client's buffer went back under its low-water mark (True) or over (False)."""
        if self.done.done() or ok is not self.behind:
            return
        self.behind = not ok
        self._cancel_timers()
        if self.behind:
            # The instance's silence clock stops while the client is the one behind.
            self.source.pause_reading()
            self._slow = self._loop.call_later(self.write_timeout, self._end, End(Why.CLIENT))
        else:
            self.source.resume_reading()
            self.last_event = self._loop.time()
            self._quiet = self._loop.call_at(self.last_event + self.silence, self._check_quiet)

    def _check_quiet(self) -> None:
        self._quiet = None
        if self.done.done() or self.behind:
            return
        due = self.last_event + self.silence
        if self._loop.time() >= due:
            self._end(End(Why.QUIET))
        else:
            self._quiet = self._loop.call_at(due, self._check_quiet)

    # ------------------------------------------------------------ the end

    def _end(self, end: End) -> None:
        if not self.done.done():
            self.done.set_result(end)
        self._cancel_timers()

    def _cancel_timers(self) -> None:
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
        if self._slow is not None:
            self._slow.cancel()
            self._slow = None
