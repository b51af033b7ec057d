"""A scripted upstream on loopback: per request, the bytes to send, in pieces and with pauses.

What our HTTP/1.1 client (gateway/upstream/connection.py, pool.py) is tested against when a
real socket matters: keep-alive, reuse, a peer that closes, bytes that arrive together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gateway.upstream import connection as h1
from gateway.upstream import pool as h1_pool

CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def fixed(body: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


# One answer per request: the bytes to send, in pieces, and pauses (s) between them; None
# closes the connection there; HOLD waits for the client to close it.
HOLD = float("inf")
Answer = list[bytes | float | None]


class Server:
    """Reads each request (head and Content-Length body) and plays the next answer."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a connection ended (the client closed it)
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.answers.pop(0):
                    if piece is None:
                        writer.close()
                        return
                    if piece == HOLD:
                        await reader.read()  # until the client closes
                    elif isinstance(piece, float):
                        await asyncio.sleep(piece)
                    else:
                        writer.write(piece)
                        await writer.drain()
            await reader.read()  # until the client closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


@contextlib.asynccontextmanager
async def server(answers: list[Answer]) -> AsyncIterator[Server]:
    srv = Server(answers)
    listener = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
    srv.port = listener.sockets[0].getsockname()[1]
    try:
        yield srv
    finally:
        listener.close()


def url(srv: Server, path: str = "/v1/chat/completions") -> str:
    return f"http://127.0.0.1:{srv.port}{path}"


async def request(pool: h1_pool.Pool, srv: Server, timeout: float = 2.0) -> h1.Response:
    return await pool.request(
        "POST", url(srv), body=b'{"x":1}', headers={"X-Request-Id": "r1"}, timeout=timeout
    )
