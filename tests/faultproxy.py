"""A fault-injecting TCP proxy for tests, after toxiproxy (which is not installable here).

    async with FaultProxy(upstream_port) as proxy:   # listens on 127.0.0.1, port 0
        ...point the gateway at proxy.url...
        proxy.hang = True                    # accept, swallow requests, never answer
        proxy.reset_after_bytes = 600        # RST the client after 600 bytes of an answer
        await proxy.refuse()                 # stop listening and drop open connections
        await proxy.restore()                # listen again on the same port

Toxics are plain attributes read on every chunk, so they act on connections the client
already pooled as well as on new ones. Every connection is recorded (`connections`) with
when each side closed, so a test can assert "the instance saw its connection close within
a second" without sleeping. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

_READ = 65536
_TRICKLE_TICK = 0.05  # seconds between slices of a trickled chunk


@dataclass
class Conn:
    """One client connection through the proxy, as the proxy saw it."""

    opened_at: float
    bytes_up: int = 0  # client -> upstream, forwarded
    bytes_down: int = 0  # upstream -> client, forwarded
    answer_bytes: int = 0  # bytes of the current answer (reset when the client sends)
    hung: bool = False  # client bytes arrived while hanging and were swallowed
    reset: bool = False  # the proxy reset the client side with an RST
    client_closed_at: float | None = None  # the client side ended (EOF, reset or error)
    upstream_closed_at: float | None = None  # the upstream side ended


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN: SO_LINGER with a zero timeout, then abort."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.latency_up = 0.0  # seconds added before forwarding each client chunk
        self.latency_down = 0.0  # seconds added before forwarding each upstream chunk
        self.hang = False  # swallow client bytes; connections accepted now never go upstream
        self.reset_after_bytes: int | None = None  # RST the client after N bytes of an answer
        self.reset_on_accept = False  # RST every new connection at once
        self.trickle_bytes_per_s: float | None = None  # throttle upstream -> client
        self.connections: list[Conn] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._live: dict[int, list[asyncio.StreamWriter]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def seen(self) -> int:
        """Connections accepted so far."""
        return len(self.connections)

    def open_connections(self) -> list[Conn]:
        return [c for c in self.connections if c.client_closed_at is None]

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.url

    async def refuse(self) -> None:
        """Stop listening (connects get ECONNREFUSED) and cut open connections, like a crash."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
        for writers in list(self._live.values()):
            for writer in writers:
                _rst(writer)

    async def restore(self) -> None:
        """Listen again on the same port."""
        if self._server is None:
            await self.start()

    async def close(self) -> None:
        await self.refuse()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        # Our own task (not the one asyncio makes for a coroutine callback) so close() can
        # cancel it without asyncio logging the cancellation as an unhandled error.
        conn = Conn(opened_at=time.monotonic())
        self.connections.append(conn)
        task = asyncio.create_task(self._serve(conn, creader, cwriter))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self, conn: Conn, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter
    ) -> None:
        key = id(conn)
        self._live[key] = [cwriter]
        try:
            if self.reset_on_accept:
                conn.reset = True
                _rst(cwriter)
                return
            uwriter: asyncio.StreamWriter | None = None
            ureader: asyncio.StreamReader | None = None
            if not self.hang:
                try:
                    ureader, uwriter = await asyncio.open_connection(*self.upstream)
                except OSError:
                    conn.upstream_closed_at = time.monotonic()
                    _rst(cwriter)
                    return
                self._live[key].append(uwriter)
            pumps = [asyncio.create_task(self._pump_up(conn, creader, uwriter))]
            if ureader is not None:
                pumps.append(asyncio.create_task(self._pump_down(conn, ureader, cwriter)))
            try:
                await asyncio.gather(*pumps)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            now = time.monotonic()
            conn.client_closed_at = conn.client_closed_at or now
            conn.upstream_closed_at = conn.upstream_closed_at or now
            for writer in self._live.pop(key, []):
                writer.close()

    async def _pump_up(
        self, conn: Conn, creader: asyncio.StreamReader, uwriter: asyncio.StreamWriter | None
    ) -> None:
        """Client -> upstream until the client closes; then close upstream (the abort signal)."""
        try:
            while data := await creader.read(_READ):
                conn.answer_bytes = 0
                if self.hang or uwriter is None:
                    conn.hung = True
                    continue
                if self.latency_up:
                    await asyncio.sleep(self.latency_up)
                uwriter.write(data)
                await uwriter.drain()
                conn.bytes_up += len(data)
        except OSError:
            pass
        conn.client_closed_at = conn.client_closed_at or time.monotonic()
        if uwriter is not None:
            uwriter.close()

    async def _pump_down(
        self, conn: Conn, ureader: asyncio.StreamReader, cwriter: asyncio.StreamWriter
    ) -> None:
        """Upstream -> client, applying latency, trickle and reset; then close the client."""
        try:
            while data := await ureader.read(_READ):
                if self.latency_down:
                    await asyncio.sleep(self.latency_down)
                limit = self.reset_after_bytes
                if limit is not None and conn.answer_bytes + len(data) >= limit:
                    await self._send(conn, cwriter, data[: max(0, limit - conn.answer_bytes)])
                    conn.reset = True
                    conn.client_closed_at = time.monotonic()
                    _rst(cwriter)
                    break
                await self._send(conn, cwriter, data)
        except OSError:
            pass
        conn.upstream_closed_at = conn.upstream_closed_at or time.monotonic()
        cwriter.close()

    async def _send(self, conn: Conn, cwriter: asyncio.StreamWriter, data: bytes) -> None:
        if not data:
            return
        rate = self.trickle_bytes_per_s
        step = len(data) if not rate else max(1, int(rate * _TRICKLE_TICK))
        for start in range(0, len(data), step):
            if rate and start:
                await asyncio.sleep(_TRICKLE_TICK)
            piece = data[start : start + step]
            cwriter.write(piece)
            await cwriter.drain()
            conn.bytes_down += len(piece)
            conn.answer_bytes += len(piece)

    def __repr__(self) -> str:
        toxics = [
            name
            for name, on in [
                ("hang", self.hang),
                (
                    f"latency={self.latency_up}/{self.latency_down}",
                    self.latency_up or self.latency_down,
                ),
                (f"reset_after={self.reset_after_bytes}", self.reset_after_bytes is not None),
                ("reset_on_accept", self.reset_on_accept),
                (f"trickle={self.trickle_bytes_per_s}", self.trickle_bytes_per_s),
                ("refusing", self._server is None),
            ]
            if on
        ]
        return (
            f"<FaultProxy :{self.port} -> {self.upstream[0]}:{self.upstream[1]} "
            f"seen={self.seen} open={len(self.open_connections())} toxics={toxics or 'none'}>"
        )


async def eventually(check: Callable[[], bool], timeout: float = 5.0, what: str = "") -> float:
    """Poll `check` every 10 ms until it holds; return the seconds it took, or fail."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not check():
        if loop.time() - started > timeout:
            raise AssertionError(f"not within {timeout}s: {what or check}")
        await asyncio.sleep(0.01)
    return loop.time() - started
