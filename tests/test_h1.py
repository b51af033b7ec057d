"""upstream/connection.py's HTTP/1.1 client on real loopback sockets, for what needs one:
connecting, and the pool's real connections kept, dropped and refused as the server sees
them. Parsing, framing, keep-alive and flow control are tested bytes in, bytes out on a mock
transport in `test_connection_transport.py`."""

from __future__ import annotations

import asyncio

import pytest
from scripted_upstream import CHUNKED_HEAD, HOLD, Answer, chunk, fixed, request, server

from gateway.upstream import pool as h1_pool
from gateway.upstream.response import AttemptFailed


async def test_a_content_length_answer_is_read_whole_and_its_connection_kept() -> None:
    """A Content-Length answer reads whole; the next request reuses the same connection."""
    async with server([[fixed(b"hello")], [fixed(b"again")]]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        first = await request(pool, srv)
        assert await first.read(1.0) == b"hello"
        first.close()
        second = await request(pool, srv)
        assert await second.read(1.0) == b"again"
        second.close()
        assert srv.connections == 1
        assert pool.opened == 1
        assert srv.requests[1].endswith(b'Content-Length: 7\r\n\r\n{"x":1}')
        pool.close()


async def test_an_instance_closing_mid_body_breaks_the_answer() -> None:
    """A real socket closed before the Content-Length is met breaks the answer after the
    bytes that came: asyncio's EOF and loss reach the connection as the mock transport says."""
    cut: Answer = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"data: 1\n\n", None]
    async with server([cut]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        response = await request(pool, srv)
        assert await response.next_chunk() == b"data: 1\n\n"
        with pytest.raises(AttemptFailed) as info:
            await response.next_chunk(timeout=2.0)
        assert info.value.kind == "connect"
        response.close()
        assert "open=0/4" in repr(pool)
        pool.close()


async def test_an_answer_left_unfinished_drops_its_connection() -> None:
    """Closing an answer before its end closes the connection (the instance sees us leave)
    and the next request opens a new one."""
    unfinished: Answer = [CHUNKED_HEAD, chunk(b"data: 1\n\n"), HOLD]
    async with server([unfinished, [fixed(b"ok")]]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        response = await request(pool, srv)
        assert await response.next_chunk() == b"data: 1\n\n"
        response.close()
        await asyncio.wait_for(srv.closed.wait(), 2)
        again = await request(pool, srv)
        assert await again.read(1.0) == b"ok"
        again.close()
        assert srv.connections == 2
        pool.close()


async def test_no_head_in_time_is_a_timeout_and_no_listener_a_connect_failure() -> None:
    """Headers that do not come within the timeout give "timeout"; a closed port "connect"."""
    async with server([[HOLD]]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        with pytest.raises(AttemptFailed) as info:
            await request(pool, srv, timeout=0.1)
        assert info.value.kind == "timeout"
        await asyncio.wait_for(srv.closed.wait(), 2)  # the half-open request was dropped
        port = srv.port
    pool = h1_pool.Pool(4, 1.0)
    with pytest.raises(AttemptFailed) as refused:
        await pool.request("POST", f"http://127.0.0.1:{port}/", body=b"", headers={}, timeout=1)
    assert refused.value.kind == "connect"
