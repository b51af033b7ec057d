"""Bounds on client connections: header, idle and cap, enforced below aiohttp.

aiohttp times nothing per request on the server side: its `keepalive_timeout` (3,630 s
by default) closes a connection only while it waits for a next request, silently, and
counts from the last answer, so a slowloris sending a header line every 10 s and an
idle keep-alive connection both stay for an hour. Here each connection's protocol is
wrapped in `_Connection`, which owns one timer and moves through four phases:

    HEADERS --headers parsed--> ACTIVE --answer, keep-alive--> IDLE --first byte--> HEADERS
                                  └------answer, close-------> CLOSING

- HEADERS: from accept (or from the first byte after an idle spell) the whole request
  head must arrive within `header_timeout`; else 408 if a byte came, and close.
- ACTIVE: no timer here; the body read has its own (`body_timeout`, in the proxy) and
  the rest is bounded by `request_timeout`.
- IDLE: a kept-alive connection waits at most `idle_timeout` for a next request.
- CLOSING: the answer said `Connection: close`; aiohttp may still drain an unread body
  for up to its lingering time (10 s), and `header_timeout` ends that sooner if shorter.

The moment the head is parsed is the moment aiohttp calls its request handler, which
`wrap_handler` wraps; the wrapper finds its `_Connection` through the transport's
public `get_protocol()`. Beyond `max_client_connections` a connection gets no aiohttp
handler: `_Refusal` answers 503 at once, half-closes, and drops what the client sends.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web

from gateway import errors
from gateway.observe import log
from gateway.observe.metrics import Metrics

_log = log.get("gateway.connections")

RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    idle_timeout: float
    max_open: int


def raw_answer(error: errors.GatewayError, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 answer with `Connection: close`, for when no request object exists."""
    body = error.body()
    head = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_HEADER_TIMEOUT = raw_answer(
    errors.RequestTimeout("the request headers did not arrive within the gateway's header_timeout")
)
_OVER_LIMIT = raw_answer(
    errors.TooManyConnections(
        "the gateway has as many client connections open as it allows; retry shortly"
    ),
    retry_after=1,
)


class Phase(enum.Enum):
    HEADERS = "headers"
    ACTIVE = "active"
    IDLE = "idle"
    CLOSING = "closing"


class ClientConnections:
    """Makes each client connection's protocol and counts the connections it cuts."""

    def __init__(self, limits: ConnectionLimits, metrics: Metrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.open: set[_Connection] = set()
        self.refusing: set[_Refusal] = set()

    def __repr__(self) -> str:
        return (
            f"ClientConnections(open={len(self.open)}/{self.limits.max_open}, "
            f"refusing={len(self.refusing)})"
        )

    def protocol_factory(
        self, make_handler: Callable[[], asyncio.Protocol], *, limit: int | None = None
    ) -> Callable[[], asyncio.Protocol]:
        """The factory for `loop.create_server`: aiohttp's protocol inside ours, or a refusal.

        `limit`: the connections this listener's own may add beyond `max_open` (the admin
        listener's: probes and scrapes must get in when the API's clients fill it up).
        """
        extra = [0]  # connections of this listener open beyond max_open

        def factory() -> asyncio.Protocol:
            if len(self.open) >= self.limits.max_open:
                if limit is None or extra[0] >= limit:
                    return _Refusal(self)
                extra[0] += 1
                connection = _Connection(make_handler(), self)
                connection.on_close = lambda: extra.__setitem__(0, extra[0] - 1)
                return connection
            return _Connection(make_handler(), self)

        return factory

    def wrap_handler(self, handler: RequestHandler) -> RequestHandler:
        """aiohttp's request handler, telling the connection when a request starts and ends."""

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            transport = request.transport
            connection = transport.get_protocol() if transport is not None else None
            if not isinstance(connection, _Connection):
                return await handler(request)
            connection.request_started()
            keep_alive = False
            try:
                response = await handler(request)
                if not request.content.is_eof() and not response.prepared:
                    # Answered without reading the body (401, 413): what follows on the
                    # connection is the rest of that body, not a next request.
                    response.force_close()
                keep_alive = request.keep_alive and response.keep_alive is not False
                return response
            finally:
                connection.request_finished(keep_alive)

        return handle

    def cut(self, reason: str) -> None:
        self.metrics.client_connections_closed.labels(reason).inc()

    def close(self) -> None:
        """Ends the refusals still draining (aiohttp shuts the served connections down)."""
        for refusal in list(self.refusing):
            refusal.close()


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the header and idle timers around it."""

    def __init__(self, inner: asyncio.Protocol, owner: ClientConnections) -> None:
        self.inner = inner
        self.owner = owner
        self.phase = Phase.HEADERS
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when the timer fires
        self._due: float | None = None  # when the phase's time is up (None: no limit now)
        self._got_bytes = False  # of the request whose head is awaited
        self._writing_paused = False  # the transport's buffer is over its high-water mark
        self._on_writing: Callable[[bool], None] | None = None  # a spliced stream (splice.py)
        self.on_close: Callable[[], None] | None = None  # its listener's count, if any
        # Counted from here, not connection_made: one accept burst makes many protocols
        # before any is connected, and the cap must see each of them.
        owner.open.add(self)
        owner.metrics.client_connections.inc()

    def __repr__(self) -> str:
        return f"_Connection(phase={self.phase.value}, got_bytes={self._got_bytes})"

    # asyncio.Protocol, each passed on to aiohttp's protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self.transport = cast(asyncio.Transport, transport)
        self._arm(self.owner.limits.header_timeout)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if data and not self._got_bytes and self.phase in (Phase.HEADERS, Phase.IDLE):
            self._got_bytes = True
            if self.phase is Phase.IDLE:
                self.phase = Phase.HEADERS
                self._arm(self.owner.limits.header_timeout)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self._writing_paused = True
        self.inner.pause_writing()
        if self._on_writing is not None:
            self._on_writing(False)

    def resume_writing(self) -> None:
        self._writing_paused = False
        self.inner.resume_writing()
        if self._on_writing is not None:
            self._on_writing(True)

    def watch_writing(self, listener: Callable[[bool], None] | None) -> bool:
        """Tell `listener` when the write buffer goes over its high-water mark (False) and
        back under the low one (True); None stops. Returns whether it is over now."""
        self._on_writing = listener
        return self._writing_paused

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self in self.owner.open:
            self.owner.open.discard(self)
            self.owner.metrics.client_connections.dec()
            if self.on_close is not None:
                self.on_close()
        self.transport = None
        self.inner.connection_lost(exc)

    # what the wrapped request handler reports

    def request_started(self) -> None:
        self._disarm()
        self.phase = Phase.ACTIVE

    def request_finished(self, keep_alive: bool) -> None:
        self.phase = Phase.IDLE if keep_alive else Phase.CLOSING
        self._got_bytes = False
        if self.transport is not None:
            limits = self.owner.limits
            self._arm(limits.idle_timeout if keep_alive else limits.header_timeout)

    # the timer

    # One timer, re-armed lazily (as splice._check_quiet): a phase only moves `_due`, and
    # the timer is moved when it fires early or must fire sooner, not twice a request.

    def _arm(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        due = self._due = loop.time() + delay
        if self._timer is not None and self._timer_at <= due:
            return  # it fires first, and re-arms for `due` then
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(due, self._check), due

    def _disarm(self) -> None:
        self._due = None

    def _check(self) -> None:
        self._timer = None
        due = self._due
        if due is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < due:
            self._timer, self._timer_at = loop.call_at(due, self._check), due
            return
        self._due = None
        self._expired()

    def _expired(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.phase is Phase.CLOSING:
            # Its answer said close and was counted; this only ends the draining of an
            # unread body (aiohttp lingers up to 10 s) sooner.
            self.transport.close()
            return
        if self.phase is Phase.HEADERS:
            reason = "header_timeout"
            if self._got_bytes:  # a request was begun: tell its client why it ends
                self.transport.write(_HEADER_TIMEOUT)
        else:
            reason = "idle_timeout"
        self.owner.cut(reason)
        _log.debug("client_connection_cut", reason=reason, peer=_peer(self.transport))
        self.transport.close()  # flushes what was written, then connection_lost


class _Refusal(asyncio.Protocol):
    """A connection over the cap: 503 at once, then drop its bytes until it leaves.

    Closing with the client's request unread would make the kernel send a reset, which
    can destroy the 503 before the client reads it; so the refusal half-closes and
    reads to the client's end, for at most `header_timeout`.
    """

    def __init__(self, owner: ClientConnections) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self.transport = cast(asyncio.Transport, transport)
        self.owner.refusing.add(self)
        self.owner.cut("over_limit")
        self.transport.write(_OVER_LIMIT)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.owner.limits.header_timeout, self.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request it would have carried; already answered

    def eof_received(self) -> bool:
        return False  # the client is done too: let the transport close

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.owner.refusing.discard(self)
        self.transport = None


def _peer(transport: asyncio.BaseTransport) -> Any:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) else peer
