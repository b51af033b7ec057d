"""Our HTTP/1.1 client against an instance that misbehaves: nothing reaches the next client.

After each case the pool is checked for its places (none lost, none held by a connection
out of step) and the next request's answer for foreign bytes, status or headers.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from scripted_upstream import CHUNKED_HEAD, Answer, chunk, fixed, request, server

from gateway.upstream import pool as h1_pool
from gateway.upstream.response import AttemptFailed

EXTRA_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 9\r\n\r\ndata: x\n\n"
)
CLEAN = fixed(b"B's own answer")


def _busy(pool: h1_pool.Pool) -> int:
    """Connections open and not idle (a leaked place shows here)."""
    found = re.search(r"open=(\d+)/\d+ idle=(\d+)", repr(pool))
    assert found is not None
    return int(found[1]) - int(found[2])


async def _next_client_is_clean(pool: h1_pool.Pool, srv: object) -> None:
    """The next request gets exactly the answer the script gives it, on a sound connection."""
    response = await request(pool, srv)  # type: ignore[arg-type]
    assert response.status == 200
    assert "X-Junk" not in response.headers
    assert await response.read(2.0) == b"B's own answer"
    response.close()


@pytest.mark.parametrize(
    "answer",
    [
        fixed(b"A's answer") + EXTRA_ANSWER,
        CHUNKED_HEAD + chunk(b"A's answer") + b"0\r\n\r\n" + EXTRA_ANSWER,
        fixed(b"A's answer") + b"HTTP/1.1 503 Service Unavailable\r\nX-Junk: ",
        fixed(b"A's answer") + b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nX-Junk: ",
    ],
    ids=["extra-answer", "extra-after-chunked", "partial-503", "trailing-header"],
)
async def test_bytes_after_an_answer_end_its_connection_not_the_answer(answer: bytes) -> None:
    """A's answer arrives whole with its own headers; what follows it costs only the socket."""
    async with server([[answer], [CLEAN]]) as srv:
        pool = h1_pool.Pool(1, 1.0)  # one place: a leaked one would stall the next request
        response = await request(pool, srv)
        assert await response.read(2.0) == b"A's answer"
        assert "Content-Encoding" not in response.headers
        assert "X-Junk" not in response.headers
        response.close()
        await _next_client_is_clean(pool, srv)
        assert srv.connections == 2  # the first connection was not reused
        pool.close()


async def test_a_304_with_a_body_is_not_reused() -> None:
    """A 304 has no body by definition: bytes after its head are out of step."""
    answer = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\nhello" + EXTRA_ANSWER
    async with server([[answer], [CLEAN]]) as srv:
        pool = h1_pool.Pool(1, 1.0)
        response = await request(pool, srv)
        assert response.status == 304
        assert await response.read(2.0) == b""
        response.close()
        await _next_client_is_clean(pool, srv)
        assert srv.connections == 2
        pool.close()


async def test_an_upgrade_is_a_clean_failure(caplog: pytest.LogCaptureFixture) -> None:
    """101 Switching Protocols fails the attempt as a bad response; nothing escapes the loop."""
    answer = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    async with server([[answer], [CLEAN]]) as srv:
        pool = h1_pool.Pool(1, 1.0)
        with pytest.raises(AttemptFailed) as failed:
            await request(pool, srv)
        assert failed.value.kind == "bad_response"
        assert "Fatal error" not in caplog.text
        await _next_client_is_clean(pool, srv)
        pool.close()


@pytest.mark.parametrize("pieces", [1, 3], ids=["one-read", "three-reads"])
async def test_a_head_over_the_limit_fails_however_it_arrives(pieces: int) -> None:
    """A 96 KB head is refused whether it comes in one read or in several."""
    filler = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"y" * 1000) for i in range(96))
    head = b"HTTP/1.1 200 OK\r\n" + filler + b"Content-Length: 2\r\n\r\nok"
    step = len(head) // pieces + 1
    answer: Answer = []
    for i in range(0, len(head), step):
        answer += [head[i : i + step], 0.02]
    async with server([answer, [CLEAN]]) as srv:
        pool = h1_pool.Pool(1, 1.0)
        with pytest.raises(AttemptFailed) as failed:
            await request(pool, srv)
        assert failed.value.kind == "bad_response"
        await _next_client_is_clean(pool, srv)
        pool.close()


async def test_a_woken_waiter_that_is_cancelled_hands_its_place_on() -> None:
    """One place, two waiters: the first is woken then cancelled; the second gets the place."""
    async with server([[fixed(b"first")], [CLEAN]]) as srv:
        pool = h1_pool.Pool(1, 1.0)
        holder = await request(pool, srv)
        cancelled = asyncio.create_task(request(pool, srv))
        patient = asyncio.create_task(request(pool, srv, timeout=3.0))
        await asyncio.sleep(0.05)  # both wait for the one place
        assert await holder.read(2.0) == b"first"
        holder.close()  # wakes the first waiter...
        cancelled.cancel()  # ...which leaves before it runs
        response = await asyncio.wait_for(patient, 2.0)
        assert await response.read(2.0) == b"B's own answer"
        response.close()
        assert cancelled.cancelled()
        pool.close()


async def test_a_stale_kept_alive_connection_is_retried_once_on_a_new_one() -> None:
    """The instance closed the idle socket as we reused it: the request goes again, fresh."""
    async with server([[fixed(b"first")], [None], [CLEAN]]) as srv:
        pool = h1_pool.Pool(2, 1.0)
        first = await request(pool, srv)
        assert await first.read(2.0) == b"first"
        first.close()  # kept alive, back in the pool
        await _next_client_is_clean(pool, srv)
        assert srv.connections == 2
        assert len(srv.requests) == 3  # the stale try reached the instance, then the retry
        pool.close()


async def test_a_new_connection_that_closes_is_a_connect_failure() -> None:
    """Only a reused socket is stale: a fresh one closed without an answer is the instance's."""
    async with server([[None]]) as srv:
        pool = h1_pool.Pool(2, 1.0)
        with pytest.raises(AttemptFailed) as failed:
            await request(pool, srv)
        assert failed.value.kind == "connect"
        pool.close()


async def test_idle_connections_are_closed_on_time() -> None:
    """A connection idle past `keepalive` is closed by the pool's timer, not when next taken."""
    async with server([[fixed(b"first")]]) as srv:
        pool = h1_pool.Pool(2, 1.0, keepalive=0.1)
        response = await request(pool, srv)
        assert await response.read(2.0) == b"first"
        response.close()
        await asyncio.wait_for(srv.closed.wait(), 2.0)  # the server saw us leave
        assert "open=0/2 idle=0" in repr(pool)
        pool.close()


# A matrix of answers an instance may send, each followed by a clean request that must get
# exactly its own answer on a pool of one place: nothing leaks into it, no place is lost.
# `expect`: "ok" (the body arrives whole), "head" (the attempt fails before a response),
# "body" (the head arrives, the body breaks).
def _h(*lines: bytes) -> bytes:
    return b"\r\n".join(lines) + b"\r\n\r\n"


MATRIX: list[tuple[str, Answer, str, bytes]] = [
    ("cl-exact", [fixed(b"hello")], "ok", b"hello"),
    (
        "cl-short-then-close",
        [_h(b"HTTP/1.1 200 OK", b"Content-Length: 9") + b"hel", None],
        "body",
        b"",
    ),
    ("cl-zero", [_h(b"HTTP/1.1 200 OK", b"Content-Length: 0")], "ok", b""),
    ("cl-negative", [_h(b"HTTP/1.1 200 OK", b"Content-Length: -1") + b"x"], "head", b""),
    ("cl-not-a-number", [_h(b"HTTP/1.1 200 OK", b"Content-Length: ten") + b"x"], "head", b""),
    (
        "cl-twice-differing",
        [_h(b"HTTP/1.1 200 OK", b"Content-Length: 1", b"Content-Length: 2") + b"xy"],
        "head",
        b"",
    ),
    (
        "cl-and-chunked",
        [
            _h(b"HTTP/1.1 200 OK", b"Content-Length: 3", b"Transfer-Encoding: chunked")
            + chunk(b"abc")
            + b"0\r\n\r\n"
        ],
        "head",
        b"",
    ),
    ("chunked", [CHUNKED_HEAD + chunk(b"ab") + chunk(b"cd") + b"0\r\n\r\n"], "ok", b"abcd"),
    ("chunked-extension", [CHUNKED_HEAD + b"2;name=value\r\nab\r\n0\r\n\r\n"], "ok", b"ab"),
    ("chunked-trailer", [CHUNKED_HEAD + chunk(b"ab") + b"0\r\nX-Trailer: 1\r\n\r\n"], "ok", b"ab"),
    ("chunked-bad-size", [CHUNKED_HEAD + b"zz\r\nab\r\n0\r\n\r\n"], "body", b""),
    ("chunked-no-end-then-close", [CHUNKED_HEAD + chunk(b"ab"), None], "body", b""),
    (
        "chunked-split-everywhere",
        [CHUNKED_HEAD, b"2", b"\r", b"\na", b"b\r\n", b"0\r\n", b"\r\n"],
        "ok",
        b"ab",
    ),
    ("no-framing-until-close", [_h(b"HTTP/1.1 200 OK") + b"all of it", None], "ok", b"all of it"),
    ("http-1.0-keep-nothing", [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"], "ok", b"ok"),
    ("connection-close", [fixed(b"ok", b"Connection: close"), None], "ok", b"ok"),
    ("continue-then-answer", [b"HTTP/1.1 100 Continue\r\n\r\n" + fixed(b"ok")], "ok", b"ok"),
    (
        "early-hints-then-answer",
        [_h(b"HTTP/1.1 103 Early Hints", b"Link: </x>") + fixed(b"ok")],
        "ok",
        b"ok",
    ),
    (
        "two-interim-then-answer",
        [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 102 Processing\r\n\r\n", fixed(b"ok")],
        "ok",
        b"ok",
    ),
    ("status-not-a-number", [_h(b"HTTP/1.1 abc OK", b"Content-Length: 0")], "head", b""),
    ("not-http", [b"SSH-2.0-OpenSSH\r\n\r\n"], "head", b""),
    ("http-2-preface", [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"], "head", b""),
    (
        "header-without-colon",
        [_h(b"HTTP/1.1 200 OK", b"Broken header", b"Content-Length: 0")],
        "head",
        b"",
    ),
    (
        "header-line-too-long",
        [_h(b"HTTP/1.1 200 OK", b"X-Big: " + b"y" * 9000, b"Content-Length: 0")],
        "head",
        b"",
    ),
    (
        "many-small-headers",
        [
            _h(b"HTTP/1.1 200 OK", *(b"X-%d: v" % i for i in range(500)), b"Content-Length: 2")
            + b"ok"
        ],
        "ok",
        b"ok",
    ),
    ("close-before-head", [None], "head", b""),
    ("close-mid-head", [b"HTTP/1.1 200 OK\r\nContent-Le", None], "head", b""),
    (
        "garbage-after-chunked-end",
        [CHUNKED_HEAD + chunk(b"ab") + b"0\r\n\r\n" + b"\x00\xffjunk"],
        "ok",
        b"ab",
    ),
    (
        "sse-split-mid-event",
        [CHUNKED_HEAD + chunk(b'data: {"a"'), 0.02, chunk(b":1}\n\n") + b"0\r\n\r\n"],
        "ok",
        b'data: {"a":1}\n\n',
    ),
]


@pytest.mark.parametrize(
    ("answer", "expect", "body"), [m[1:] for m in MATRIX], ids=[m[0] for m in MATRIX]
)
async def test_an_answer_of_any_shape_reaches_no_other_client(
    answer: Answer, expect: str, body: bytes
) -> None:
    """The attempt gets its own answer or a clean failure; the next request, on a pool of one
    place, gets exactly its own answer; no connection is left open behind."""
    async with server([answer, [CLEAN]]) as srv:
        pool = h1_pool.Pool(1, 1.0)
        if expect == "head":
            with pytest.raises(AttemptFailed):
                await request(pool, srv)
        else:
            response = await request(pool, srv)
            if expect == "ok":
                assert await response.read(2.0) == body
            else:
                with pytest.raises(AttemptFailed):
                    await response.read(2.0)
            response.close()
        await _next_client_is_clean(pool, srv)
        assert _busy(pool) == 0  # every connection left is idle, ready for the next request
        pool.close()


async def test_an_answer_nobody_asked_for_on_an_idle_connection_closes_it() -> None:
    """Bytes that arrive on a pooled connection with no request out drop that connection;
    the next request goes on a new one and gets its own answer."""
    async with server([[fixed(b"first"), 0.05, fixed(b"unasked")], [CLEAN]]) as srv:
        pool = h1_pool.Pool(1, 1.0)
        response = await request(pool, srv)
        assert await response.read(2.0) == b"first"
        response.close()  # back in the pool, idle
        await asyncio.sleep(0.2)  # the unasked answer arrives there
        assert "open=0/1" in repr(pool)
        await _next_client_is_clean(pool, srv)
        assert srv.connections == 2
        pool.close()
