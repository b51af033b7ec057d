"""A small HTTP/1.1 client: httptools (llhttp) on pooled connections, for every call to an
instance.

The connection's own `asyncio.Protocol` parses the answer with httptools, the parser
aiohttp and uvicorn use, and hands each body chunk on from `data_received`: queued for
`next_chunk()` (and `read()`) until a stream is committed, then pushed to a `Sink`
(relay/splice.py) with no await per chunk, where a general client would hand each read
to an awaiting task. Failures are `AttemptFailed`, raised here where they enter.

`pool.Pool` keeps the connections: keep-alive per instance, `limit` open in all. A
connection goes back to it only when its answer ended cleanly (the parser saw the whole
message and the instance did not say close) and nothing followed it: as in h11, a message
is a boundary, and any byte after the end of the answer (a second, unrequested answer, or
the start of one) makes the connection unusable, so it can never reach the next request.
Each answer owns its header map. Every way the parser can refuse the bytes (a malformed
head, an upgrade, a head over `_MAX_HEAD` however it is split across reads) fails that
attempt cleanly.
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

from gateway.upstream.response import MAX_WHOLE_BYTES, AttemptFailed, AttemptKind

Key = tuple[str, int, bool]  # host, port, TLS: the connections that can serve one another
_MAX_HEAD = 64 * 1024  # an answer head longer than this is no vLLM's
_MAX_LINE = 8190  # per header line: aiohttp's and nginx's default limit
_HIGH_WATER = 64 * 1024  # bytes queued unread before the socket read pauses (uvicorn's)


class _Owner(Protocol):
    """The pool a connection reports to (pool.Pool): back when clean, or gone."""

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
        "_held",
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
        self._held: list[bytes] = []  # spliced chunks of the read being parsed (see _flush)

    @property
    def content_type(self) -> str:
        value = self.headers.get("Content-Type", "")
        return value.partition(";")[0].strip().lower()

    @property
    def fully_read(self) -> bool:
        """The whole body arrived and has been pulled: nothing is left to read or splice."""
        return self.complete and not self._chunks

    # -------------------------------------------------------- pulling

    async def next_chunk(self, timeout: float | None = None) -> bytes:
        """The body bytes that arrived since the last call, at least one chunk; b"" at the end
        (AttemptFailed if it broke)."""
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
        chunks = self._chunks  # all that arrived so far, as one read brought it
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._queued -= len(data)
        if self._queued < _HIGH_WATER and self._conn is not None:
            self._conn.resume_reading()
        return data

    async def read(self, timeout: float, limit: int = MAX_WHOLE_BYTES) -> bytes:
        """The whole body, within `timeout` seconds and `limit` bytes: past it, the answer
        is closed (its connection dropped) and AttemptFailed "bad_response" raised."""
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout):
                while chunk := await self.next_chunk():
                    size += len(chunk)
                    if size > limit:
                        self.close()
                        raise AttemptFailed("bad_response", f"body over {limit} bytes")
                    parts.append(chunk)
        except TimeoutError:
            raise AttemptFailed("timeout", f"body not read within {timeout:.1f}s") from None
        return b"".join(parts)

    # -------------------------------------------------------- pushing

    def splice(self, sink: Sink) -> None:
        """From now on hand every body chunk to `sink` as it arrives (queued ones first).

        The chunks of one read go on together (the queued ones, then those each read
        brings): an instance that sends a burst of events costs one write to the client,
        not one per event."""
        if self._chunks:
            queued = self._chunks
            sink.body(queued[0] if len(queued) == 1 else b"".join(queued))
            queued.clear()
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
        else it is dropped (the instance sees its client leave), and a reader still waiting
        for its body is told it broke. Idempotent."""
        conn, self._conn = self._conn, None
        self._sink = None
        self._held.clear()
        if conn is not None:
            conn.finished(self)
        self._end("closed by the gateway before it ended")

    # -------------------------------------------------------- from the connection

    def _body(self, data: bytes) -> None:
        if self._sink is not None:
            self._held.append(data)  # handed on once the read is parsed (_flush)
            return
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued >= _HIGH_WATER and self._conn is not None:
            self._conn.pause_reading()
        self._wake()

    def _flush(self) -> None:
        """Hand the sink the chunks the read being parsed brought, in one piece."""
        held = self._held
        if held and self._sink is not None:
            data = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            self._sink.body(data)

    def _end(self, broken: str | None) -> None:
        if self.complete or self.broken is not None:
            return
        self._flush()  # what arrived before the end goes first
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
        return f"<Response {self.status} {state} {mode}>"


class _HeadTooLarge(Exception):
    pass


class _AfterTheEnd(Exception):
    """Bytes arrived after the answer ended: the connection is out of step for good."""


class H1Connection(asyncio.Protocol):
    """One keep-alive connection to an instance: parses answers as their bytes arrive."""

    def __init__(self, pool: _Owner, key: Key) -> None:
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
        self._head_bytes = 0  # of the answer's head, line by line as parsed
        self._head_read = 0  # bytes read while its head is awaited (a line may be unfinished)
        self._framed = False  # the answer has a length or is chunked: its end is in band
        self._ended = False  # the answer to the request in flight was parsed whole
        self._heard = False  # a byte of the answer arrived (else a reused socket was stale)

    def __repr__(self) -> str:
        host, port, _ = self.key
        state = (
            "closed" if self.transport is None else "busy" if self.head or self.response else "idle"
        )
        return f"<H1Connection {host}:{port} {state} used={self.used}>"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # the request goes in one write, but a token must not wait
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes, head: asyncio.Future[Response]) -> None:
        assert self.transport is not None
        self.head, self.response, self.reusable = head, None, False
        self._headers, self._head_bytes, self._head_read = CIMultiDict(), 0, 0
        self._framed = self._ended = self._heard = False
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.head is None and self.response is None:
            self.abort()  # bytes nobody asked for: the connection is not in step
            return
        self._heard = True
        if self.head is not None:
            self._head_read += len(data)
        try:
            self.parser.feed_data(data)
            if self.response is not None:
                self.response._flush()
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            cause = exc.__context__
            if isinstance(cause, _AfterTheEnd):
                self.reusable = False  # the answer is whole; only the connection goes
                self.abort()
                return
            if isinstance(exc, httptools.HttpParserUpgrade):
                self._broken("bad_response", "the instance switched protocols")
                return
            cause = cause if isinstance(cause, _HeadTooLarge) else exc
            # The parser's message may quote header bytes; only its gist goes on.
            self._broken("bad_response", str(cause).split(":", 1)[0].strip()[:120])
        else:
            if self.head is not None and self._head_read > _MAX_HEAD:
                self._broken("bad_response", f"answer head over {_MAX_HEAD} bytes")

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._ended:
            raise _AfterTheEnd  # a second answer to one request (llhttp parses on past the end)
        self._headers = CIMultiDict()  # each answer, an interim one too, has its own headers
        self._head_bytes = 0

    def on_status(self, status: bytes) -> None:
        self._count_head(len(status) + 15)  # "HTTP/1.1 NNN " and the line's end

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > _MAX_LINE:
            raise _HeadTooLarge(f"Got more than {_MAX_LINE} bytes when reading a header line")
        self._count_head(len(name) + len(value) + 4)
        self._headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def _count_head(self, size: int) -> None:
        # Counted per parsed line, so a head that arrives in one read is bounded too.
        self._head_bytes += size
        if self._head_bytes > _MAX_HEAD:
            raise _HeadTooLarge(f"answer head over {_MAX_HEAD} bytes")

    def on_headers_complete(self) -> None:
        head, self.head = self.head, None
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: an interim answer; the real head follows
            self.head = head
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
        self._ended = True
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
        # A kept-alive socket the instance closed before a byte of the answer: the instance
        # dropped an idle connection as we reused it, which says nothing of its health.
        self._broken("stale" if self.used and not self._heard else "connect", why)
        self.pool.lost(self)

    def _broken(self, kind: AttemptKind, detail: str) -> None:
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
