"""A small HTTP/1.1 client for streamed answers: httptools (llhttp) on pooled connections.

aiohttp's client hands each read of a stream to an awaiting task (a future and a task
step per chunk). Here the connection's own `asyncio.Protocol` parses the answer with
httptools, the parser aiohttp and uvicorn use, and hands each body chunk on from
`data_received`: queued for `next_chunk()` until the stream is committed, then pushed to a
`Sink` (splice.py) with no await per chunk. `upstream/client.py` is the seam that decides when it is
used; failures are its `AttemptFailed`, raised here where they enter.

`h1_pool.Pool` keeps the connections: keep-alive per instance, `limit` open in all. A
connection goes back to it only when its answer ended cleanly (the parser saw the whole
message and the instance did not say close).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Mapping
from typing import Protocol, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.upstream.response import AttemptFailed

_MAX_HEAD = 64 * 1024  # an answer head longer than this is no vLLM's
_MAX_LINE = 8190  # per header line: aiohttp's limit, so both clients refuse the same heads
_HIGH_WATER = 64 * 1024  # bytes queued unread before the socket read pauses (uvicorn's)


# Failures are the seam's own AttemptFailed, raised where they enter: `upstream/client.py`
# imports this module only when it starts, so the import goes one way at load time.


class _Owner(Protocol):
    """The pool a connection reports to (h1_pool.Pool): back when clean, or gone."""

    def give_back(self, conn: H1Connection) -> None: ...

    def lost(self, conn: H1Connection) -> None: ...


class Sink(Protocol):
    """Where a spliced answer's body goes, as it arrives."""

    def body(self, data: bytes) -> None: ...

    def ended(self, broken: str | None) -> None:
        """The answer ended: None when the whole message arrived, else why it broke."""


class Response:
    """An answer whose head arrived: status, headers, then its body pulled or pushed."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_queued",
        "_sink",
        "_waiter",
        "broken",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, conn: H1Connection, status: int, headers: CIMultiDict[str]) -> None:
        self._conn: H1Connection | None = conn
        self.status = status
        self.headers: Mapping[str, str] = CIMultiDictProxy(headers)
        self.complete = False  # the parser saw the end of the message
        self.broken: str | None = None  # why the body ended early, if it did
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None

    @property
    def content_type(self) -> str:
        value = self.headers.get("Content-Type", "")
        return value.partition(";")[0].strip().lower()

    # -------------------------------------------------------- pulling

    async def next_chunk(self, timeout: float | None = None) -> bytes:
        """The next body bytes as they arrived; b"" at the end (AttemptFailed if it broke)."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.broken is not None:
                raise AttemptFailed("connect", self.broken)
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:
                    await waiter
                else:
                    async with asyncio.timeout(timeout):
                        await waiter
            except TimeoutError:
                raise AttemptFailed("timeout", f"no bytes within {timeout:.1f}s") from None
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        self._queued -= len(data)
        if self._queued < _HIGH_WATER and self._conn is not None:
            self._conn.resume_reading()
        return data

    async def read(self, timeout: float) -> bytes:
        """The whole body, within `timeout` seconds."""
        parts: list[bytes] = []
        try:
            async with asyncio.timeout(timeout):
                while chunk := await self.next_chunk():
                    parts.append(chunk)
        except TimeoutError:
            raise AttemptFailed("timeout", f"body not read within {timeout:.1f}s") from None
        return b"".join(parts)

    # -------------------------------------------------------- pushing

    def splice(self, sink: Sink) -> None:
        """From now on hand every body chunk to `sink` as it arrives (queued ones first)."""
        while self._chunks:
            sink.body(self._chunks.popleft())
        self._queued = 0
        if self.complete or self.broken is not None:
            sink.ended(None if self.complete else self.broken)
            return
        self._sink = sink
        if self._conn is not None:
            self._conn.resume_reading()

    def pause_reading(self) -> None:
        """Stop reading the instance's socket (its kernel buffer fills, then its sends wait)."""
        if self._conn is not None:
            self._conn.pause_reading()

    def resume_reading(self) -> None:
        if self._conn is not None:
            self._conn.resume_reading()

    # -------------------------------------------------------- ending

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool if it ended cleanly,
        else it is dropped (the instance sees its client leave). Idempotent."""
        conn, self._conn = self._conn, None
        self._sink = None
        if conn is not None:
            conn.finished(self)

    release = close

    # -------------------------------------------------------- from the connection

    def _body(self, data: bytes) -> None:
        if self._sink is not None:
            self._sink.body(data)
            return
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued >= _HIGH_WATER and self._conn is not None:
            self._conn.pause_reading()
        self._wake()

    def _end(self, broken: str | None) -> None:
        if self.complete or self.broken is not None:
            return
        if broken is None:
            self.complete = True
        else:
            self.broken = broken
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.ended(broken)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "broken" if self.broken else "open"
        mode = "spliced" if self._sink is not None else f"queued={self._queued}"
        return f"<h1.Response {self.status} {state} {mode}>"


class _Refused(Exception):
    """Raised in a parser callback to stop the parse: the answer is refused, for this reason."""


class H1Connection(asyncio.Protocol):
    """One keep-alive connection to an instance: parses answers as their bytes arrive."""

    def __init__(self, pool: _Owner, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[Response] | None = None  # waiting for the answer's head
        self.reusable = False  # the last answer ended cleanly and keeps the connection
        self.idle_since = 0.0
        self.used = 0  # answers read on it
        self.paused = False  # its socket is not being read (flow control)
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._head_bytes = 0
        self._framed = False  # the answer has a length or is chunked: its end is in band

    def __repr__(self) -> str:
        host, port = self.key
        state = (
            "closed" if self.transport is None else "busy" if self.head or self.response else "idle"
        )
        return f"<h1.H1Connection {host}:{port} {state} used={self.used}>"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # the request goes in one write, but a token must not wait
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes, head: asyncio.Future[Response]) -> None:
        assert self.transport is not None
        self.head, self.response, self.reusable = head, None, False
        self._headers, self._head_bytes, self._framed = CIMultiDict(), 0, False
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.head is None and self.response is None:
            self.abort()  # bytes nobody asked for: the connection is not in step
            return
        if self.head is not None:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, _Refused) else exc
            # The parser's message may quote header bytes; only its gist goes on.
            self._broken("bad_response", str(cause).split(":", 1)[0].strip()[:120])
        else:
            if self.head is not None and self._head_bytes > _MAX_HEAD:
                self._broken("bad_response", f"answer head over {_MAX_HEAD} bytes")

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > _MAX_LINE:
            raise _Refused(f"Got more than {_MAX_LINE} bytes when reading a header line")
        self._headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        if self.head is None:
            # Bytes behind a complete answer: the connection is out of step with its requests.
            raise _Refused("an answer nobody asked for followed the last one")
        head, self.head = self.head, None
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: an interim answer; the real head follows
            self.head = head
            self._headers = CIMultiDict()
            return
        headers = self._headers
        self._framed = (
            "Content-Length" in headers or "chunked" in headers.get("Transfer-Encoding", "").lower()
        )
        self.response = Response(self, status, headers)
        if head is not None and not head.done():
            head.set_result(self.response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._body(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None:
            return
        self.used += 1
        self.reusable = self.parser.should_keep_alive()
        response._end(None)

    # flow control

    def pause_reading(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    # the end

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.response is not None and not self._framed and not self.response.broken:
            self.response._end(None)  # an answer without a length ends when its connection does
        why = f"{type(exc).__name__}: {exc}" if exc else "the instance closed the connection"
        self._broken("connect", why)
        self.pool.lost(self)

    def _broken(self, kind: str, detail: str) -> None:
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_exception(AttemptFailed(kind, detail))
        if self.response is not None:
            self.response._end(f"broke the stream after it started ({detail})")
        self.reusable = False
        self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def finished(self, response: Response) -> None:
        """The answer's reader is done with it: keep the connection or drop it."""
        if response is not self.response:
            return
        self.response = None
        if response.complete and self.reusable and self.transport is not None:
            self.resume_reading()
            self.pool.give_back(self)
        else:
            self.abort()
