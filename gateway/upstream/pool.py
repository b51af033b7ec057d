"""The pool of connection.py's connections: keep-alive per instance, `limit` open in all.

Idle connections for another instance are closed to make room; beyond that a request
waits for a connection to close or come back. The request goes out in one write. A
connection comes back only when its answer ended cleanly (connection.py decides), so an answer
closed early drops its connection and the instance sees its client leave. Idle connections
are closed once they have been idle `keepalive` seconds, by a timer, not only when next
taken. A kept-alive connection that the instance had closed as we reused it ("stale": not
a byte of the answer came) is no fault of the instance: the request goes again, once, on a
new connection. Requests that wait for a place get one in the order they came: a place
that frees goes to the first waiter, and nobody who asks meanwhile takes it before that
waiter runs (httpcore assigns it to the waiter). A waiter woken for a place and cancelled
before it ran hands the wake-up on, so no place sits idle while others wait.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gateway.upstream.connection import H1Connection, Key, Response
from gateway.upstream.response import AttemptFailed

if TYPE_CHECKING:
    from gateway.config.load import Config

# vLLM (uvicorn) closes idle connections after 5 s; dropping ours sooner avoids sending a
# request down a socket the instance is closing.
KEEPALIVE_S = 4.0


class Pool:
    """Keep-alive connections per instance, at most `limit` open in all."""

    def __init__(self, limit: int, connect_timeout: float, keepalive: float = KEEPALIVE_S) -> None:
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.opened = 0  # connections made, for tests and metrics
        self._idle: dict[Key, list[H1Connection]] = {}
        self._all: set[H1Connection] = set()
        self._connecting = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._promised = 0  # places handed to woken waiters that have not run yet
        self._targets: dict[str, tuple[Key, str, bytes]] = {}
        self._reaper: asyncio.TimerHandle | None = None
        self._tls: ssl.SSLContext | None = None  # made at the first https:// instance
        self.closed = False

    def apply(self, config: Config) -> None:
        """A (reloaded) configuration: its `channel.timeout.connect` bounds the connections
        opened from now on (the limit and keep-alive are fixed at start)."""
        self.connect_timeout = config.channel.timeout.connect

    def __repr__(self) -> str:
        idle = sum(len(v) for v in self._idle.values())
        paused = sum(c.paused for c in self._all)  # answers not read while their client is behind
        return (
            f"<Pool open={len(self._all)}/{self.limit} idle={idle} paused={paused} "
            f"opened={self.opened}>"
        )

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout: float,
    ) -> Response:
        """Send one request and return once the answer's head arrived (or raise AttemptFailed).

        `timeout` bounds it all; the connect alone is also bounded by `connect_timeout`.
        Cancelled or timed out, the connection is dropped: the instance sees us leave.
        """
        key, path, host = self._target(url)
        head = _request_head(method, path, host, headers, len(body) if body else 0)
        message = head + body if body else head
        loop = asyncio.get_running_loop()
        conn: H1Connection | None = None
        try:
            async with asyncio.timeout(timeout):
                conn = await self._acquire(key, loop)
                try:
                    return await self._send(conn, message, loop)
                except AttemptFailed as exc:
                    if exc.kind != "stale":
                        raise
                conn = await self._acquire(key, loop, fresh=True)
                return await self._send(conn, message, loop)
        except TimeoutError:
            if conn is not None:
                conn.abort()
            raise AttemptFailed("timeout", f"no response headers within {timeout:.1f}s") from None
        except BaseException:
            if conn is not None:
                conn.abort()
            raise

    @staticmethod
    async def _send(
        conn: H1Connection, message: bytes, loop: asyncio.AbstractEventLoop
    ) -> Response:
        waiter: asyncio.Future[Response] = loop.create_future()
        conn.send(message, waiter)
        return await waiter

    def _target(self, url: str) -> tuple[Key, str, bytes]:
        known = self._targets.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise AttemptFailed("unsendable", f"not an http(s):// URL: {url[:80]!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            path = parts.path or "/"
            if parts.query:
                path += "?" + parts.query
            host = parts.netloc.rpartition("@")[2]  # never a URL's credentials in Host
            known = ((parts.hostname, port, tls), path, host.encode("ascii"))
            if len(self._targets) < 4096:  # instances times routes; a bound, not a cache policy
                self._targets[url] = known
        return known

    async def _acquire(
        self, key: Key, loop: asyncio.AbstractEventLoop, *, fresh: bool = False
    ) -> H1Connection:
        woken = False
        while True:
            if self.closed:
                raise AttemptFailed("shutting_down", "the gateway is shutting down its connections")
            # Only a woken waiter, or one who finds nobody waiting, may take a place.
            if woken or not (self._waiters or self._promised):
                idle = None if fresh else self._idle.get(key)
                now = loop.time()
                while idle:
                    conn = idle.pop()
                    if conn.transport is not None and now - conn.idle_since < self.keepalive:
                        return conn
                    self._drop(conn)
                if len(self._all) + self._connecting < self.limit or self._evict_idle():
                    return await self._connect(key, loop)
            waiter: asyncio.Future[None] = loop.create_future()
            if woken:  # it lost its place after all: it keeps its turn
                self._waiters.appendleft(waiter)
            else:
                self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._promised -= 1
                    self._wake()  # woken, then cancelled: the place goes to the next waiter
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            self._promised -= 1
            woken = True

    async def _connect(self, key: Key, loop: asyncio.AbstractEventLoop) -> H1Connection:
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                host, port, tls = key
                _, protocol = await loop.create_connection(
                    lambda: H1Connection(self, key),
                    host,
                    port,
                    ssl=self._context() if tls else None,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            self._connecting -= 1
            self._wake()
            raise AttemptFailed(
                "connect", f"no connection within {self.connect_timeout:g}s"
            ) from None
        except BaseException as exc:
            self._connecting -= 1
            self._wake()
            if isinstance(exc, OSError):
                raise AttemptFailed("connect", f"cannot connect: {exc}") from None
            raise
        # Counted as open before it stops counting as connecting: no gap another
        # request could take to go over the limit.
        self._all.add(protocol)
        self._connecting -= 1
        self.opened += 1
        if protocol.transport is None:  # lost while we were being scheduled
            self._drop(protocol)
            raise AttemptFailed("connect", "the connection closed as it opened")
        return protocol

    def _context(self) -> ssl.SSLContext:
        """The system's trust store and hostname checks, as for any https client."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _evict_idle(self) -> bool:
        """Close the longest idle connection to any instance, to make room for one."""
        oldest: H1Connection | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        self._drop(oldest)
        return True

    def _drop(self, conn: H1Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        if conn in self._all:
            self._all.discard(conn)
            self._wake()
        conn.abort()

    def give_back(self, conn: H1Connection) -> None:
        if self.closed:
            self._drop(conn)
            return
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._reaper is None:
            self._reaper = loop.call_later(self.keepalive, self._reap)
        self._wake()

    def _reap(self) -> None:
        """Close the connections idle for `keepalive` seconds; come back for the others."""
        self._reaper = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        oldest: float | None = None
        for conns in list(self._idle.values()):
            for conn in list(conns):
                if now - conn.idle_since >= self.keepalive:
                    self._drop(conn)
                elif oldest is None or conn.idle_since < oldest:
                    oldest = conn.idle_since
        if oldest is not None:
            self._reaper = loop.call_later(oldest + self.keepalive - now, self._reap)

    def lost(self, conn: H1Connection) -> None:
        self._drop(conn)

    def _wake(self) -> None:
        """A place freed: promised to the first waiter still waiting."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._promised += 1
                return

    def close(self) -> None:
        """Drop every connection, idle or busy; open no new one."""
        self.closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for conn in list(self._all):
            self._drop(conn)
        self._idle.clear()


def _request_head(
    method: str, path: str, host: bytes, headers: Mapping[str, str], length: int
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode("ascii"), b"Host: " + host]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
            raise ValueError(f"header {name[:40]!r} cannot be sent: it holds a line break")
        lines.append(f"{name}: {value}".encode("latin-1"))
    lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"
