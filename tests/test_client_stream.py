"""client_stream.py on a mock transport: the head, the framing, the end, bytes in, bytes out."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import HttpVersion, HttpVersion10, HttpVersion11, web
from aiohttp.test_utils import make_mocked_request
from mock_transport import MockTransport, connect
from prometheus_client import CollectorRegistry

from gateway.observe.metrics import Metrics
from gateway.relay.client_stream import ANSWER_STARTED, ClientStream
from gateway.server.connections import ClientConnections, ConnectionLimits

HEADERS = {"Content-Type": "text/event-stream", "X-Gateway-Instance": "a"}


def client(
    *, high: int = 64 * 1024, version: HttpVersion = HttpVersion11, closing: bool = False
) -> tuple[web.Request, MockTransport]:
    """A request on the gateway's own client-connection protocol, over a mock transport."""
    limits = ConnectionLimits(header_timeout=60.0, idle_timeout=60.0, max_open=8)
    connections = ClientConnections(limits, Metrics(CollectorRegistry()))
    transport = connect(connections.protocol_factory(asyncio.Protocol)(), high=high, low=0)
    request = make_mocked_request(
        "POST", "/v1/completions", version=version, closing=closing, transport=transport
    )
    return request, transport


def split(written: bytearray) -> tuple[dict[str, str], bytes]:
    head, body = bytes(written).split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK"
    return dict(line.split(": ", 1) for line in lines[1:]), body


async def test_the_head_goes_out_with_the_first_events_then_each_write_is_one_chunk() -> None:
    """The head waits for the first bytes and leaves in their write; every write after it is
    one HTTP/1.1 chunk, the end is the last chunk, and the body is counted unframed."""
    request, transport = client()
    out = ClientStream(dict(HEADERS), write_timeout=1)
    await out.prepare(request)
    assert out.prepared
    assert transport.written == b""
    await out.write(b"data: 1\n\n")
    headers, body = split(transport.written)
    assert headers["Transfer-Encoding"] == "chunked"
    assert headers["X-Gateway-Instance"] == "a"
    assert {"Date", "Server"} <= headers.keys()
    assert "Connection" not in headers
    assert body == b"9\r\ndata: 1\n\n\r\n"
    assert out.send(b"data: 2\n\n")
    await out.end(b"data: [DONE]\n\n")
    assert bytes(transport.written).endswith(
        b"9\r\ndata: 2\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    )
    assert out.body_length == 2 * 9 + 14
    assert out.keep_alive is True
    assert request[ANSWER_STARTED]
    assert "ended chunked" in repr(out)


async def test_aiohttp_finishing_the_answer_writes_nothing_more() -> None:
    """aiohttp's own prepare and write_eof, once the handler returns, add no byte: an ended
    stream stays as it is; one not ended is cut, without a last chunk and not kept alive."""
    request, transport = client()
    out = ClientStream(dict(HEADERS), write_timeout=1)
    await out.prepare(request)
    await out.end()
    written = bytes(transport.written)
    await out.prepare(request)
    await out.write_eof()
    assert transport.written == written
    assert out.keep_alive

    request, transport = client()
    out = ClientStream(dict(HEADERS), write_timeout=1)
    await out.prepare(request)
    await out.write(b"data: 1\n\n")
    await out.write_eof()
    assert not bytes(transport.written).endswith(b"0\r\n\r\n")
    assert out.keep_alive is False
    assert not out.send(b"data: 2\n\n")
    with pytest.raises(ConnectionResetError):
        await out.end()


async def test_an_http_1_0_client_gets_the_bytes_bare_and_a_client_saying_close_is_told() -> None:
    """To HTTP/1.0 the body goes unframed and the connection ends with it; an HTTP/1.1
    client that sent `Connection: close` is answered `Connection: close`."""
    request, transport = client(version=HttpVersion10)
    out = ClientStream(dict(HEADERS), write_timeout=1)
    await out.prepare(request)
    await out.end(b"data: 1\n\n")
    assert bytes(transport.written).startswith(b"HTTP/1.0 200 OK\r\n")
    assert bytes(transport.written).endswith(b"\r\n\r\ndata: 1\n\n")
    assert out.keep_alive is False

    request, transport = client(closing=True)  # it sent `Connection: close`
    out = ClientStream(dict(HEADERS), write_timeout=1)
    await out.prepare(request)
    await out.end(b"data: 1\n\n")
    headers, _ = split(transport.written)
    assert headers["Connection"] == "close"
    assert out.keep_alive is False


async def test_a_write_waits_while_the_client_is_behind_and_lets_it_go_after_the_timeout() -> None:
    """Over the client's high-water mark a write waits for it to drain; behind for longer
    than `write_timeout`, the client is let go (ConnectionResetError) and the stream cut."""
    request, transport = client(high=64)
    out = ClientStream(dict(HEADERS), write_timeout=5)
    await out.prepare(request)
    waiting = asyncio.ensure_future(out.write(b"data: 1\n\n"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    transport.take()
    await asyncio.wait_for(waiting, 1)

    request, transport = client(high=64)
    out = ClientStream(dict(HEADERS), write_timeout=0.05)
    await out.prepare(request)
    with pytest.raises(ConnectionResetError, match="stayed behind"):
        await out.write(b"data: 1\n\n")
    assert out.keep_alive is False
    assert "cut" in repr(out)


async def test_a_gone_client_and_a_header_with_a_line_break_are_refused() -> None:
    """A client whose transport is closing cannot be answered; a header value holding a line
    break is refused rather than sent (no header injection)."""
    request, transport = client()
    transport.close()
    with pytest.raises(ConnectionResetError):
        await ClientStream(dict(HEADERS), write_timeout=1).prepare(request)
    request, _ = client()
    out = ClientStream({"X-Tag": "a\r\nEvil: 1"}, write_timeout=1)
    with pytest.raises(ValueError, match="line break"):
        await out.prepare(request)
