"""The floor of a Python front: the least a forwarder built on our stack can cost a request.

Two forwarders with nothing of the gateway's but its HTTP/1.1 client (`gateway.upstream`):
no key check, no dispatch (round robin), no metrics, no access line, no tracing. They read
the client's request, send it to the next instance, and pass the answer's body on with
chunked framing, the head going out with the first chunk and the later chunks written
straight to the client's socket, as the gateway's relay and splice send them.

- `aiohttp`: on aiohttp's web server, as the gateway is (uvloop, no access log);
- `httptools`: on a bare asyncio protocol with httptools' request parser, as uvicorn's
  `httptools_impl.py` is: what a server of our own would cost at the least.

`overhead` runs them beside the gateway (`floor-aiohttp`, `floor-httptools`): the first is
the part of the gateway's cost no change inside it can remove while it serves on aiohttp,
the second what replacing aiohttp's server would leave. They keep a connection alive and
answer one request at a time on it (no pipelining), which is what the load generator
does; they are measuring instruments, not fronts to deploy.

`python -m loadtest.floor --server aiohttp|httptools --instances URL ...` serves on a free
loopback port and prints its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import socket
import sys
from collections.abc import Iterator, Sequence

import httptools
import uvloop
from aiohttp import web

from gateway.config.schema import Timeouts
from gateway.upstream.client import Upstream
from gateway.upstream.connection import Response

SERVERS = ("aiohttp", "httptools")
_TIMEOUT = 60.0
_FORWARDED = {"content-type": "application/json"}


def _chunk(data: bytes) -> bytes:
    """`data` as one chunk of HTTP/1.1 chunked framing."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Forwarder:
    """Round robin over the instances through one `Upstream` pool."""

    def __init__(self, instances: Sequence[str]) -> None:
        self.upstream = Upstream(1024, Timeouts())
        self._next: Iterator[str] = itertools.cycle([u.rstrip("/") for u in instances])

    async def open(self, path: str, body: bytes) -> Response:
        return await self.upstream.open(
            "POST", next(self._next) + path, body=body, headers=_FORWARDED, timeout=_TIMEOUT
        )


class _Deferred(web.StreamResponse):
    """aiohttp's streamed response with its head sent with the first chunk, as the gateway's
    relay sends it (relay.py)."""

    _send_headers_immediately = False


def aiohttp_app(forwarder: _Forwarder) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        response = await forwarder.open(request.path, await request.read())
        out = _Deferred(status=response.status, headers={"Content-Type": response.content_type})
        out.enable_chunked_encoding()
        await out.prepare(request)
        try:
            # The head and first chunk through aiohttp, the rest straight to the socket, as
            # the gateway's splice writes them; the last chunk through aiohttp again.
            await out.write(await response.next_chunk(_TIMEOUT))
            transport = request.transport
            while (data := await response.next_chunk(_TIMEOUT)) and transport is not None:
                transport.write(_chunk(data))
        finally:
            response.close()
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/{tail:.*}", forward)
    app.router.add_get("/health", health)
    return app


class HttptoolsExchange(asyncio.Protocol):
    """One client connection on httptools' parser: each request forwarded once it is whole."""

    def __init__(self, forwarder: _Forwarder) -> None:
        self.forwarder = forwarder
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._write(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path, body = self.url.decode(), b"".join(self.body)
        self.url, self.body = b"", []
        if self.parser.get_method() == b"GET":
            self._write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return
        asyncio.get_running_loop().create_task(self._forward(path, body))

    async def _forward(self, path: str, body: bytes) -> None:
        response = await self.forwarder.open(path, body)
        head = b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % (
            response.status,
            response.content_type.encode(),
        )
        try:
            while data := await response.next_chunk(_TIMEOUT):
                self._write(head + _chunk(data))
                head = b""
            self._write(head + b"0\r\n\r\n")
        finally:
            response.close()

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(server: str, instances: Sequence[str], port: int) -> None:
    forwarder = _Forwarder(instances)
    await forwarder.upstream.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    if server == "aiohttp":
        runner = web.AppRunner(aiohttp_app(forwarder), access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock, backlog=1024).start()
    else:
        sock.listen(1024)
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: HttptoolsExchange(forwarder), sock=sock)
    print(url, flush=True)
    await asyncio.Event().wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.floor", description=__doc__)
    parser.add_argument("--server", choices=SERVERS, required=True)
    parser.add_argument("--instances", nargs="+", required=True, help="instance base URLs")
    parser.add_argument("--port", type=int, default=0, help="loopback port (0: a free one)")
    args = parser.parse_args(argv)
    try:
        uvloop.run(serve(args.server, args.instances, args.port))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
