"""A committed stream's one writer: its head, every event, the chunk framing, the last chunk.

As uvicorn's `RequestResponseCycle` owns every write of its answer, `ClientStream` writes
all of a stream's bytes itself, straight to the client's transport (aiohttp's public
`request.transport`), and counts them: `prepare` fixes the head (after the app's
`on_response_prepare` signal, as aiohttp's own `prepare` runs it), the first write sends
it with the first events, `send` frames and writes at once (the splice's, with no await),
`write` does the same and waits while the client is behind, and `end` writes the last
chunk. aiohttp's own writer never writes a byte of it.

It is a `web.StreamResponse` because a handler returns one: once the handler returns,
aiohttp (web_protocol's `finish_response`) calls `prepare` and `write_eof` on it and reads
`keep_alive`; the access record reads `prepared` and `body_length`. Each is overridden here
from what this object did, through public names only. A stream the relay did not `end` by
then is incomplete: it gets no last chunk, and its connection is not reused.

    new --prepare--> prepared --first write--> sending --end--> ended
                         └──────────────────────┴--cut, or aiohttp's write_eof--> cut
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from email.utils import formatdate
from typing import cast

from aiohttp import __version__ as aiohttp_version
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from gateway.relay.splice import Watch

# Set on the request once its answer's first bytes are out: the server's error handler
# then sends no second answer (aiohttp's own check counts only its writer's bytes).
ANSWER_STARTED = web.RequestKey("answer_started", bool)

_LAST_CHUNK = b"0\r\n\r\n"
# What aiohttp's own answers say (its SERVER_SOFTWARE), so every answer names one server.
SERVER = f"Python/{sys.version_info[0]}.{sys.version_info[1]} aiohttp/{aiohttp_version}"


class ClientStream(web.StreamResponse):
    """The client's side of one committed stream; `body_length` counts its body bytes only
    (no head, no framing), as a whole answer's Content-Length does."""

    def __init__(self, headers: dict[str, str], *, write_timeout: float, status: int = 200):
        super().__init__(status=status, headers=headers)
        self.write_timeout = write_timeout  # how long an awaited write waits for the client
        self.state = "new"
        self.sent = 0  # body bytes written
        self.framed = False
        self.reuse = False  # the connection may serve a next request once this ends
        self.transport: asyncio.Transport | None = None
        self.watch: Watch | None = None  # the client connection's protocol
        self.head: bytes | None = None  # until it goes out with the first bytes
        self.request: web.BaseRequest | None = None

    def __repr__(self) -> str:
        framing = "chunked" if self.framed else "bare"
        return f"<ClientStream {self.state} {framing} sent={self.sent} reuse={self.reuse}>"

    # ------------------------------------------------------------ the head

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """Fix the head; ConnectionResetError if the client is gone. Once only: aiohttp's
        own call, after the handler, does nothing."""
        if self.state != "new":
            return None
        transport = request.transport
        if transport is None or transport.is_closing():
            self.state = "cut"
            raise ConnectionResetError("the client left before the answer began")
        if isinstance(request, web.Request):
            for app in request.match_info.apps:
                if app.on_response_prepare:
                    await app.on_response_prepare.send(request, self)
        self.transport = transport
        # Every client connection is served by server/connections.py's protocol, which
        # reports its write buffer (the runner wraps each one); kept, as asyncio forgets
        # the protocol once the connection is lost.
        self.watch = cast(Watch, transport.get_protocol())
        self.request = request
        self.head = self._head(request)
        self.state = "prepared"
        return None

    def _head(self, request: web.BaseRequest) -> bytes:
        """The status line and headers, as aiohttp's `StreamResponse` would write them for a
        body of unknown length: chunked to an HTTP/1.1 client, bare (and the connection
        closed after) to an HTTP/1.0 one."""
        version = request.version
        headers = self.headers
        self.framed = version >= (1, 1)
        self.reuse = request.keep_alive and self.framed
        if self.framed:
            headers["Transfer-Encoding"] = "chunked"
        if "Date" not in headers:
            headers["Date"] = formatdate(usegmt=True)
        headers.setdefault("Server", SERVER)
        if "Connection" not in headers and not self.reuse and self.framed:
            headers["Connection"] = "close"
        lines = [f"HTTP/{version.major}.{version.minor} {self.status} {self.reason}"]
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"a line break in the answer's header {name!r}: {value!r}")
            lines.append(f"{name}: {value}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    # ------------------------------------------------------------ the body

    def send(self, data: bytes) -> bool:
        """Write `data` now, framed (the head first if it has not gone); False if the client
        is gone or the stream is over. No await: the splice's way."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.state not in _OPEN:
            return False
        if data:
            self.sent += len(data)
            if self.framed:
                data = b"%x\r\n%b\r\n" % (len(data), data)
        head = self.head
        if head is not None:
            data = self._started(head) + data
        if data:
            transport.write(data)
        return True

    def _started(self, head: bytes) -> bytes:
        self.head = None
        self.state = "sending"
        if self.request is not None:
            self.request[ANSWER_STARTED] = True
        return head

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write `data`, then wait while the client is behind: ConnectionResetError if it
        is gone, or stays behind for `write_timeout`."""
        if not self.send(bytes(data)):
            raise ConnectionResetError("the client left")
        await self._drain()

    async def end(self, data: bytes = b"") -> None:
        """Write the last bytes and the last chunk, and wait while the client is behind
        (ConnectionResetError as `write`); a second end writes nothing."""
        if self.state == "ended":
            return
        transport = self.transport
        if transport is None or transport.is_closing() or self.state not in _OPEN:
            raise ConnectionResetError("the client left")
        self.sent += len(data)
        if self.framed:
            data = (b"%x\r\n%b\r\n" % (len(data), data) if data else b"") + _LAST_CHUNK
        head = self.head
        if head is not None:
            data = self._started(head) + data
        self.state = "ended"
        if data:
            transport.write(data)  # in one write with the last events, if any
        await self._drain()

    def cut(self) -> None:
        """The stream stops here, incomplete (the client left or is let go): no last chunk,
        and the connection is not reused."""
        if self.state != "ended":
            self.state = "cut"
            self.reuse = False

    async def _drain(self) -> None:
        transport, watch = self.transport, self.watch
        if transport is None or watch is None or not transport.get_write_buffer_size():
            return  # the socket took it all
        caught_up = asyncio.get_running_loop().create_future()

        def writing(ok: bool) -> None:
            if ok and not caught_up.done():
                caught_up.set_result(None)

        try:
            if not watch.watch_writing(writing):
                return
            async with asyncio.timeout(self.write_timeout):
                await caught_up
        except TimeoutError:
            self.cut()
            raise ConnectionResetError(
                f"the client stayed behind for {self.write_timeout:g}s"
            ) from None
        finally:
            watch.watch_writing(None)

    def watch_writing(self, listener: Callable[[bool], None] | None) -> bool:
        """The client connection's reports of its write buffer (splice.Watch), passed on."""
        assert self.watch is not None, "prepare first"
        return self.watch.watch_writing(listener)

    # ------------------------------------------------------------ what aiohttp asks

    async def write_eof(self, data: bytes = b"") -> None:
        """aiohttp's, once the handler returned: a stream not ended by then is cut."""
        self.cut()

    def force_close(self) -> None:
        self.reuse = False

    @property
    def prepared(self) -> bool:
        return self.state != "new"

    @property
    def keep_alive(self) -> bool:
        return self.reuse and self.state == "ended"

    @property
    def body_length(self) -> int:
        return self.sent


_OPEN = frozenset({"prepared", "sending"})
