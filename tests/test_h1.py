"""upstream/connection.py's HTTP/1.1 client against a loopback server sending scripted bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from scripted_upstream import CHUNKED_HEAD, HOLD, Answer, chunk, fixed, request, server

from gateway.upstream import pool as h1_pool
from gateway.upstream.response import AttemptFailed


class Collect:
    """A sink that keeps what it is handed."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.end: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    def body(self, data: bytes) -> None:
        self.chunks.append(data)

    def ended(self, broken: str | None) -> None:
        self.end.set_result(broken)


async def test_a_chunked_answer_arrives_chunk_by_chunk_and_the_request_goes_out_whole() -> None:
    """Each chunk of a chunked answer is handed on as it arrives; the request is well formed."""
    answer: Answer = [
        CHUNKED_HEAD,
        chunk(b"data: 1\n\n"),
        0.05,
        chunk(b"data: 2\n\n"),
        b"0\r\n\r\n",
    ]
    async with server([answer]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        response = await request(pool, srv)
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.content_type == "text/event-stream"
        assert await response.next_chunk() == b"data: 1\n\n"
        assert await response.next_chunk() == b"data: 2\n\n"
        assert await response.next_chunk() == b""
        assert response.complete
        response.close()
        sent = srv.requests[0]
        assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"\r\nX-Request-Id: r1\r\n" in sent
        assert sent.endswith(b'Content-Length: 7\r\n\r\n{"x":1}')
        pool.close()


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


async def test_connection_close_is_honoured() -> None:
    """An answer that says `Connection: close` does not leave its connection in the pool."""
    async with server([[fixed(b"a", b"Connection: close")], [fixed(b"b")]]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        for expected in (b"a", b"b"):
            response = await request(pool, srv)
            assert await response.read(1.0) == expected
            response.close()
        assert pool.opened == 2
        pool.close()


async def test_a_connection_closed_mid_body_is_a_broken_answer() -> None:
    """An answer cut off before its Content-Length is broken: pulling raises, a sink is told."""
    cut: Answer = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"data: 1\n\n", 0.05, None]
    async with server([cut, list(cut)]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        response = await request(pool, srv)
        assert await response.next_chunk() == b"data: 1\n\n"
        with pytest.raises(AttemptFailed) as info:
            await response.next_chunk()
        assert info.value.kind == "connect"
        response.close()

        pushed = await request(pool, srv)
        sink = Collect()
        pushed.splice(sink)
        broken = await asyncio.wait_for(sink.end, 2)
        assert sink.chunks == [b"data: 1\n\n"]
        assert broken is not None
        assert "broke the stream after it started" in broken
        pushed.close()
        pool.close()


async def test_a_spliced_chunked_answer_ends_cleanly_and_keeps_its_connection() -> None:
    """Pushed to a sink, a chunked answer's chunks arrive in order, its end is clean and its
    connection goes back to the pool."""
    answer: Answer = [
        CHUNKED_HEAD,
        chunk(b"data: 1\n\n"),
        0.02,
        chunk(b"data: 2\n\n"),
        b"0\r\n\r\n",
    ]
    async with server([answer, [fixed(b"next")]]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        response = await request(pool, srv)
        sink = Collect()
        response.splice(sink)
        assert await asyncio.wait_for(sink.end, 2) is None
        assert b"".join(sink.chunks) == b"data: 1\n\ndata: 2\n\n"
        response.close()
        again = await request(pool, srv)
        assert await again.read(1.0) == b"next"
        again.close()
        assert srv.connections == 1
        pool.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Huge: " + b"a" * 20000 + b"\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["bad-status", "header-too-long", "not-http"],
)
async def test_a_bad_head_is_a_bad_response(head: bytes) -> None:
    """A head that does not parse, or a header line over 8190 bytes, is "bad_response",
    and the message does not quote the instance's bytes."""
    async with server([[head]]) as srv:
        pool = h1_pool.Pool(4, 1.0)
        with pytest.raises(AttemptFailed) as info:
            await request(pool, srv)
        assert info.value.kind == "bad_response"
        assert "aaaa" not in info.value.detail
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


async def test_the_pool_holds_at_most_its_limit_and_a_request_waits_for_room() -> None:
    """With a limit of one connection a second request waits until the first answer ends."""
    slow: Answer = [CHUNKED_HEAD, chunk(b"data: 1\n\n"), 0.2, b"0\r\n\r\n"]
    async with server([slow, [fixed(b"second")]]) as srv:
        pool = h1_pool.Pool(1, 1.0)
        first = await request(pool, srv)
        waiting = asyncio.create_task(request(pool, srv))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert "open=1/1" in repr(pool)
        assert await first.read(1.0) == b"data: 1\n\n"
        first.close()
        second = await asyncio.wait_for(waiting, 2)
        assert await second.read(1.0) == b"second"
        second.close()
        assert srv.connections == 1
        pool.close()


def test_a_header_with_a_line_break_is_refused() -> None:
    """A header value holding CR or LF is refused rather than sent (no header injection)."""
    head: Callable[[], bytes] = lambda: h1_pool._request_head(  # noqa: E731
        "POST", "/", b"h", {"X-Tag": "a\r\nEvil: 1"}, 0
    )
    with pytest.raises(ValueError, match="line break"):
        head()
