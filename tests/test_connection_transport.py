"""Our HTTP/1.1 client, its pool and the splice on a mock transport: bytes in, bytes out.

No sockets: each test feeds an instance's bytes straight into `H1Connection.data_received`
(through `MockTransport.feed`) and checks what the connection wrote, the `Response` it
made, and what it told its pool. The pool's tests hand it `Network.create_connection` in
place of the loop's. `tests/test_h1.py` keeps what needs a real socket.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, cast

import pytest
from aiohttp.test_utils import make_mocked_request
from mock_transport import MockTransport, Network, connect
from multidict import CIMultiDictProxy
from prometheus_client import CollectorRegistry

from gateway.config.schema import Timeouts
from gateway.observe.metrics import Metrics
from gateway.relay import splice, sse
from gateway.relay.client_stream import ClientStream
from gateway.server.connections import ClientConnections, ConnectionLimits
from gateway.upstream import connection as h1
from gateway.upstream import pool as h1_pool
from gateway.upstream.client import Upstream
from gateway.upstream.response import AttemptFailed

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def dechunk(framed: bytes) -> list[bytes]:
    """The payloads of HTTP/1.1 chunk framing (the last, empty chunk not included)."""
    payloads = []
    while framed:
        size, _, framed = framed.partition(b"\r\n")
        n = int(size, 16)
        assert framed[n : n + 2] == b"\r\n"
        payloads.append(framed[:n])
        framed = framed[n + 2 :]
    return payloads


def fixed(body: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


EVENTS = [b"data: 1\n\n", b'data: {"x": "two"}\n\n', b"data: [DONE]\n\n"]
CHUNKED = CHUNKED_HEAD + b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n"
LENGTH = fixed(b'{"ok":true}', b"Content-Type: application/json; charset=utf-8")


class Owner:
    """The pool a connection reports to: keeps what it is told."""

    def __init__(self) -> None:
        self.back: list[h1.H1Connection] = []
        self.gone: list[h1.H1Connection] = []

    def give_back(self, conn: h1.H1Connection) -> None:
        self.back.append(conn)

    def lost(self, conn: h1.H1Connection) -> None:
        self.gone.append(conn)


class Collect:
    """A sink that keeps what it is handed."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.ends: list[str | None] = []

    def body(self, data: bytes) -> None:
        self.chunks.append(data)

    def ended(self, broken: str | None) -> None:
        self.ends.append(broken)


def opened() -> tuple[h1.H1Connection, MockTransport, Owner]:
    owner = Owner()
    conn = h1.H1Connection(owner, ("10.0.0.1", 8000, False))
    return conn, connect(conn), owner


def ask(conn: h1.H1Connection) -> asyncio.Future[h1.Response]:
    head: asyncio.Future[h1.Response] = asyncio.get_running_loop().create_future()
    conn.send(REQUEST, head)
    return head


async def settle() -> None:
    """Let callbacks the loop holds run (connection_lost after a close, woken tasks)."""
    for _ in range(5):
        await asyncio.sleep(0)


# ------------------------------------------------------------------ the connection


async def test_the_request_is_written_as_given_and_the_head_resolves_before_the_body() -> None:
    """`send` writes the request bytes unchanged; the head future resolves on the head alone."""
    conn, transport, _ = opened()
    head = ask(conn)
    assert bytes(transport.written) == REQUEST
    assert "busy" in repr(conn)
    transport.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n")
    assert not head.done()
    transport.feed(b"\r\n")
    response = head.result()
    assert (response.status, response.complete) == (200, False)
    assert "open queued=0" in repr(response)


@pytest.mark.parametrize(
    ("answer", "body"),
    [(LENGTH, b'{"ok":true}'), (CHUNKED, b"".join(EVENTS))],
    ids=["content-length", "chunked"],
)
async def test_an_answer_split_at_any_byte_reads_the_same(answer: bytes, body: bytes) -> None:
    """Fed in two pieces split at every byte, or byte by byte, an answer gives the same
    status and body, ends cleanly and its connection goes back to the pool."""
    pieces = [[answer[:i], answer[i:]] for i in range(len(answer) + 1)]
    pieces.append([answer[i : i + 1] for i in range(len(answer))])
    for feeds in pieces:
        conn, transport, owner = opened()
        head = ask(conn)
        for data in feeds:
            if data:
                transport.feed(data)
        response = head.result()
        assert response.status == 200
        assert response.complete
        assert await response.read(1.0) == body
        response.close()
        assert owner.back == [conn], feeds
        assert not transport.closed


async def test_each_chunk_is_handed_on_as_it_arrives() -> None:
    """A chunked body's chunks come out of `next_chunk` as they arrive, before the answer
    ends; those that arrived together come out together."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD + chunk(EVENTS[0]))
    response = head.result()
    assert await response.next_chunk() == EVENTS[0]
    assert not response.complete
    transport.feed(chunk(EVENTS[1]))
    assert await response.next_chunk() == EVENTS[1]
    transport.feed(b"0\r\n\r\n")
    assert await response.next_chunk() == b""
    assert response.complete
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD + chunk(EVENTS[0]) + chunk(EVENTS[1]))
    response = head.result()
    assert await response.next_chunk() == EVENTS[0] + EVENTS[1]


async def test_headers_are_case_insensitive_repeatable_and_the_content_type_bare() -> None:
    """Header names match in any case, a repeated header keeps each value, and
    `content_type` is the media type alone, lower-cased."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(
        b"HTTP/1.1 201 Created\r\nContent-Type: Text/Event-Stream; charset=utf-8\r\n"
        b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nContent-Length: 0\r\n\r\n"
    )
    response = head.result()
    assert response.status == 201
    assert response.headers["content-type"] == "Text/Event-Stream; charset=utf-8"
    assert response.content_type == "text/event-stream"
    assert cast(CIMultiDictProxy[str], response.headers).getall("set-cookie") == ["a=1", "b=2"]


async def test_an_interim_answer_is_skipped_and_its_headers_not_kept() -> None:
    """A 100 Continue before the answer does not resolve the head, and its headers are not
    the answer's."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(b"HTTP/1.1 100 Continue\r\nX-Interim: yes\r\n\r\n")
    assert not head.done()
    transport.feed(fixed(b"ok"))
    response = head.result()
    assert response.status == 200
    assert "X-Interim" not in response.headers


async def test_each_answer_on_a_kept_connection_has_its_own_headers() -> None:
    """The second answer on a reused connection carries only its own headers."""
    conn, transport, owner = opened()
    first_head = ask(conn)
    transport.feed(fixed(b"a", b"X-First: 1"))
    first = first_head.result()
    first.close()
    second_head = ask(conn)
    assert bytes(transport.written) == REQUEST * 2
    transport.feed(fixed(b"b", b"X-Second: 2"))
    second = second_head.result()
    assert "X-First" not in second.headers
    assert second.headers["X-Second"] == "2"
    assert await second.read(1.0) == b"b"
    second.close()
    assert owner.back == [conn, conn]
    assert conn.used == 2


async def test_an_answer_closed_before_its_end_drops_the_connection() -> None:
    """Closing an answer whose body has not all arrived aborts the connection; it is not
    given back, and closing again does nothing more."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD + chunk(EVENTS[0]))
    response = head.result()
    response.close()
    assert transport.aborted
    assert owner.back == []
    await settle()
    assert owner.gone == [conn]
    assert "closed" in repr(conn)
    response.close()
    assert owner.back == []


async def test_a_whole_body_past_its_limit_fails_and_drops_the_connection() -> None:
    """An instance that answers more than the gateway reads whole for itself (a 64 MB
    prefill answer) fails the read as a bad response: nothing more is kept, and the
    connection does not go back to the pool."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD + chunk(b"x" * 600) + chunk(b"y" * 600))
    response = head.result()
    with pytest.raises(AttemptFailed) as failed:
        await response.read(1.0, limit=1000)
    assert failed.value.kind == "bad_response"
    assert transport.aborted
    await settle()
    assert (owner.back, owner.gone) == ([], [conn])


async def test_a_whole_body_at_its_limit_is_read() -> None:
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(fixed(b"z" * 1000))
    assert await head.result().read(1.0, limit=1000) == b"z" * 1000


async def test_a_clean_end_goes_back_once_however_often_it_is_closed() -> None:
    """An answer that ended cleanly gives its connection back on close, once."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(LENGTH)
    response = head.result()
    assert owner.back == []  # not before its reader is done with it
    response.close()
    response.close()
    assert owner.back == [conn]
    assert "idle used=1" in repr(conn)


@pytest.mark.parametrize(
    "answer",
    [
        fixed(b"a", b"Connection: close"),
        b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\na",
    ],
    ids=["connection-close", "http-1.0"],
)
async def test_an_answer_that_does_not_keep_alive_drops_its_connection(answer: bytes) -> None:
    """`Connection: close`, or HTTP/1.0 without keep-alive, ends cleanly but is not given back."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(answer)
    response = head.result()
    assert await response.read(1.0) == b"a"
    response.close()
    assert owner.back == []
    assert transport.aborted


async def test_an_answer_without_a_length_ends_with_its_connection() -> None:
    """An answer with neither Content-Length nor chunking ends cleanly when the instance
    closes, and its connection is not given back."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(b"HTTP/1.1 200 OK\r\n\r\nall of it")
    response = head.result()
    transport.feed(b" and more")
    transport.feed_eof()
    await settle()
    assert response.complete
    assert await response.read(1.0) == b"all of it and more"
    response.close()
    assert owner.back == []
    assert owner.gone == [conn]


@pytest.mark.parametrize(
    ("answer", "arrived"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ndata: 1\n\n", [b"data: 1\n\n"]),
        (CHUNKED_HEAD + chunk(EVENTS[0]) + b"40\r\npartial", [EVENTS[0] + b"partial"]),
    ],
    ids=["content-length", "chunked"],
)
async def test_eof_mid_body_breaks_the_answer(answer: bytes, arrived: list[bytes]) -> None:
    """The instance closing before the body's end breaks the answer: what arrived is read,
    then pulling raises "connect"; the pool hears the connection is gone."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(answer)
    response = head.result()
    transport.feed_eof()
    await settle()
    for data in arrived:
        assert await response.next_chunk() == data
    with pytest.raises(AttemptFailed) as info:
        await response.next_chunk()
    assert info.value.kind == "connect"
    assert response.broken is not None
    assert "broke the stream after it started" in response.broken
    assert owner.gone == [conn]
    response.close()
    assert owner.back == []


async def test_a_reset_mid_body_tells_a_sink_why() -> None:
    """A spliced answer whose connection resets tells its sink it broke, with the cause."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD + chunk(EVENTS[0]))
    response = head.result()
    sink = Collect()
    response.splice(sink)
    transport.lose(ConnectionResetError("reset by peer"))
    assert sink.chunks == [EVENTS[0]]
    assert len(sink.ends) == 1
    assert sink.ends[0] is not None
    assert "ConnectionResetError: reset by peer" in sink.ends[0]


async def test_eof_before_the_head_fails_the_request_as_connect() -> None:
    """The instance closing before any answer fails the request's head with "connect"."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed_eof()
    await settle()
    with pytest.raises(AttemptFailed) as info:
        head.result()
    assert (info.value.kind, info.value.detail) == ("connect", "the instance closed the connection")
    assert owner.gone == [conn]


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Huge: " + b"a" * 20000 + b"\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header aaaa\r\n\r\n",
    ],
    ids=["bad-status", "header-too-long", "not-http", "no-colon"],
)
async def test_a_malformed_head_is_a_bad_response(data: bytes) -> None:
    """A head that does not parse, or a header line over 8190 bytes, fails the request with
    "bad_response", does not quote the instance's bytes, and aborts the connection."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(data)
    with pytest.raises(AttemptFailed) as info:
        head.result()
    assert info.value.kind == "bad_response"
    assert "aaaa" not in info.value.detail
    assert transport.aborted


async def test_a_head_of_many_short_lines_over_64_kib_is_refused() -> None:
    """A head over 64 KiB in all is refused even when each line is short."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(b"HTTP/1.1 200 OK\r\n")
    line = b"X-Pad: " + b"p" * 100 + b"\r\n"
    while not transport.closed:
        transport.feed(line)
    with pytest.raises(AttemptFailed) as info:
        head.result()
    assert info.value.detail == "answer head over 65536 bytes"


async def test_a_bad_chunk_size_breaks_the_answer() -> None:
    """A chunk size that is not hex breaks the answer after its head and aborts."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD)
    response = head.result()
    transport.feed(b"zz\r\nhello\r\n")
    assert response.broken is not None
    assert response.broken.startswith("broke the stream after it started")
    assert transport.aborted
    response.close()
    assert owner.back == []


async def test_bytes_nobody_asked_for_abort_an_idle_connection() -> None:
    """Bytes arriving on a connection with no request out mean it is out of step: abort."""
    conn, transport, owner = opened()
    transport.feed(b"HTTP/1.1 200 OK\r\n")
    assert transport.aborted
    await settle()
    assert owner.gone == [conn]


async def test_bytes_after_a_complete_answer_keep_the_connection_out_of_the_pool() -> None:
    """A second answer arriving behind the first (nobody asked for it) makes the connection
    unusable: the first answer reads whole, and its close drops the connection."""
    conn, transport, owner = opened()
    head = ask(conn)
    transport.feed(fixed(b"a") + fixed(b"unasked"))
    response = head.result()
    assert await response.read(1.0) == b"a"
    response.close()
    assert owner.back == []
    assert transport.aborted


async def test_pulled_bytes_over_the_high_water_mark_pause_reading_until_read() -> None:
    """64 KiB queued unread pauses the socket's reading; reading them resumes it."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD)
    response = head.result()
    block = b"x" * (32 * 1024)
    transport.feed(chunk(block))
    assert not transport.reading_paused
    transport.feed(chunk(block))
    assert transport.reading_paused
    assert conn.paused
    assert await response.next_chunk() == block + block
    assert not transport.reading_paused
    assert transport.pauses == 1


async def test_splice_hands_queued_chunks_first_then_pushes_and_resumes_reading() -> None:
    """A spliced answer's sink gets the queued chunks, then each new one as it arrives, then
    a clean end; reading paused while queued resumes."""
    conn, transport, owner = opened()
    head = ask(conn)
    block = b"y" * (64 * 1024)
    transport.feed(CHUNKED_HEAD + chunk(block))
    response = head.result()
    assert transport.reading_paused
    sink = Collect()
    response.splice(sink)
    assert sink.chunks == [block]
    assert not transport.reading_paused
    transport.feed(chunk(EVENTS[0]))
    assert sink.chunks == [block, EVENTS[0]]
    assert "spliced" in repr(response)
    transport.feed(b"0\r\n\r\n")
    assert sink.ends == [None]
    response.close()
    assert owner.back == [conn]


async def test_splicing_an_answer_that_already_ended_ends_the_sink_at_once() -> None:
    """An answer complete before it is spliced hands its body and its end straight away."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(CHUNKED)
    response = head.result()
    sink = Collect()
    response.splice(sink)
    assert b"".join(sink.chunks) == b"".join(EVENTS)
    assert sink.ends == [None]


async def test_no_bytes_within_the_timeout_is_a_timeout() -> None:
    """`next_chunk` with a timeout raises "timeout" when nothing arrives in time."""
    conn, transport, _ = opened()
    head = ask(conn)
    transport.feed(CHUNKED_HEAD)
    response = head.result()
    with pytest.raises(AttemptFailed) as info:
        await response.next_chunk(timeout=0.01)
    assert info.value.kind == "timeout"


# ------------------------------------------------------------------ the pool


@pytest.fixture
async def network(monkeypatch: pytest.MonkeyPatch) -> Network:
    """The running loop's `create_connection`, replaced by mock transports."""
    net = Network()
    monkeypatch.setattr(asyncio.get_running_loop(), "create_connection", net.create_connection)
    return net


def request(
    pool: h1_pool.Pool, url: str = "http://a:8000/v1/chat/completions"
) -> asyncio.Task[h1.Response]:
    return asyncio.ensure_future(
        pool.request("POST", url, body=b'{"x":1}', headers={"X-Request-Id": "r1"}, timeout=1.0)
    )


async def test_the_pool_writes_one_well_formed_request(network: Network) -> None:
    """The request goes out in one write: line, Host, the headers, its length, the body."""
    pool = h1_pool.Pool(4, 1.0)
    pending = request(pool)
    await settle()
    assert bytes(network.last.written) == (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: a:8000\r\nX-Request-Id: r1\r\n"
        b'Content-Length: 7\r\n\r\n{"x":1}'
    )
    network.last.feed(fixed(b"ok"))
    response = await pending
    assert await response.read(1.0) == b"ok"


async def test_a_clean_answer_leaves_its_connection_for_the_next_request(network: Network) -> None:
    """After an answer read to its end, the next request to the instance reuses its connection."""
    pool = h1_pool.Pool(4, 1.0)
    for body in (b"hello", b"again"):
        pending = request(pool)
        await settle()
        network.last.feed(fixed(body))
        response = await pending
        assert await response.read(1.0) == body
        response.close()
    assert len(network.transports) == 1
    assert pool.opened == 1
    assert "open=1/4 idle=1" in repr(pool)


@pytest.mark.parametrize(
    "first",
    [CHUNKED_HEAD + chunk(EVENTS[0]), fixed(b"a", b"Connection: close")],
    ids=["closed-early", "connection-close"],
)
async def test_an_answer_that_may_not_be_reused_makes_the_next_request_connect(
    network: Network, first: bytes
) -> None:
    """An answer closed before its end, or one that says close, takes its connection with it."""
    pool = h1_pool.Pool(4, 1.0)
    pending = request(pool)
    await settle()
    network.last.feed(first)
    (await pending).close()
    await settle()
    assert network.transports[0].aborted
    assert "open=0/4" in repr(pool)
    pending = request(pool)
    await settle()
    network.last.feed(fixed(b"b"))
    assert await (await pending).read(1.0) == b"b"
    assert pool.opened == 2


async def test_a_request_waits_for_room_and_takes_the_connection_given_back(
    network: Network,
) -> None:
    """At its limit the pool makes a request wait; a clean end hands it the connection."""
    pool = h1_pool.Pool(1, 1.0)
    pending = request(pool)
    await settle()
    network.last.feed(CHUNKED_HEAD)
    first = await pending
    waiting = request(pool)
    await settle()
    assert not waiting.done()
    assert "open=1/1" in repr(pool)
    network.last.feed(chunk(EVENTS[0]) + b"0\r\n\r\n")
    assert await first.read(1.0) == EVENTS[0]
    first.close()
    await settle()
    network.last.feed(fixed(b"second"))
    second = await waiting
    assert await second.read(1.0) == b"second"
    assert len(network.transports) == 1


async def test_a_place_given_back_goes_to_the_first_waiter_not_to_a_newcomer(
    network: Network,
) -> None:
    """A request that asks right after a connection came back waits behind the request
    already waiting for it, which was woken for it (as httpcore's pool assigns it)."""
    pool = h1_pool.Pool(1, 1.0)
    pending = request(pool)
    await settle()
    network.last.feed(fixed(b"first"))
    first = await pending
    waiting = request(pool, "http://a:8000/waiting")
    await settle()
    assert await first.read(1.0) == b"first"
    newcomer = request(pool, "http://a:8000/newcomer")  # it runs before the woken waiter
    first.close()  # back to the pool: the waiter is woken, and has not run yet
    await settle()
    assert network.last.written.endswith(b'{"x":1}')
    assert b"POST /waiting " in bytes(network.last.written)
    assert b"/newcomer" not in bytes(network.last.written)
    assert not newcomer.done()
    network.last.feed(fixed(b"second"))
    second = await waiting
    assert await second.read(1.0) == b"second"
    second.close()
    await settle()
    network.last.feed(fixed(b"third"))
    assert await (await newcomer).read(1.0) == b"third"
    assert len(network.transports) == 1


async def test_an_idle_connection_to_another_instance_makes_room(network: Network) -> None:
    """At its limit the pool closes another instance's idle connection rather than wait."""
    pool = h1_pool.Pool(1, 1.0)
    pending = request(pool, "http://a:8000/")
    await settle()
    network.last.feed(fixed(b"a"))
    (await pending).close()
    pending = request(pool, "http://b:8000/")
    await settle()
    assert network.transports[0].aborted
    network.last.feed(fixed(b"b"))
    assert await (await pending).read(1.0) == b"b"
    assert len(network.transports) == 2


async def test_a_connection_idle_past_keepalive_is_not_reused(network: Network) -> None:
    """A connection idle longer than `keepalive` is dropped and a new one opened."""
    pool = h1_pool.Pool(4, 1.0, keepalive=0.0)
    for _ in range(2):
        pending = request(pool)
        await settle()
        network.last.feed(fixed(b"x"))
        (await pending).close()
    assert len(network.transports) == 2
    assert network.transports[0].aborted


async def test_no_head_in_time_is_a_timeout_and_drops_the_connection(network: Network) -> None:
    """Headers that do not come within the request's timeout give "timeout" and abort."""
    pool = h1_pool.Pool(4, 1.0)
    with pytest.raises(AttemptFailed) as info:
        await pool.request("POST", "http://a:8000/", body=None, headers={}, timeout=0.02)
    assert info.value.kind == "timeout"
    assert network.last.aborted


async def test_a_refused_connect_is_connect_and_a_foreign_url_unsendable(network: Network) -> None:
    """A connection refused fails the attempt with "connect"; a URL that is not http(s)://,
    with "unsendable", which counts as "connect"."""
    pool = h1_pool.Pool(4, 1.0)
    network.refuse = ConnectionRefusedError("refused")
    with pytest.raises(AttemptFailed) as refused:
        await request(pool)
    assert refused.value.kind == "connect"
    assert "cannot connect" in refused.value.detail
    with pytest.raises(AttemptFailed) as foreign:
        await request(pool, "ftp://a/v1")
    assert (foreign.value.kind, foreign.value.reported) == ("unsendable", "connect")
    assert "open=0/4" in repr(pool)


async def test_a_closed_pool_or_an_unsendable_header_opens_nothing(network: Network) -> None:
    """A pool the gateway closed refuses with "shutting_down", and a header holding a line
    break is "unsendable" (Upstream maps the pool's refusal); both count as "connect"."""
    upstream = Upstream(4, Timeouts())
    await upstream.start()
    with pytest.raises(AttemptFailed) as unsendable:
        await upstream.open("GET", "http://a:8000/", body=None, headers={"X": "a\r\nb"}, timeout=1)
    assert (unsendable.value.kind, unsendable.value.reported) == ("unsendable", "connect")
    await upstream.close()
    pool = h1_pool.Pool(4, 1.0)
    pool.close()
    with pytest.raises(AttemptFailed) as closing:
        await request(pool)
    assert (closing.value.kind, closing.value.reported) == ("shutting_down", "connect")
    assert network.transports == []


async def test_an_https_instance_is_reached_over_tls_with_its_name_checked(
    network: Network,
) -> None:
    """https:// connects on 443 by default with the system's trust and the host's name, and
    never shares a connection with the same host over plain http."""
    pool = h1_pool.Pool(4, 1.0)
    for url in ("https://gpu.example/v1/chat/completions", "http://gpu.example/v1/x"):
        pending = request(pool, url)
        await settle()
        network.last.feed(fixed(b"ok"))
        response = await pending
        assert await response.read(1.0) == b"ok"
        response.close()
    (host, port, tls), (_, plain_port, plain) = network.connects
    assert (host, port, plain_port) == ("gpu.example", 443, 80)
    assert isinstance(tls["ssl"], ssl.SSLContext)
    assert tls["ssl"].check_hostname
    assert tls["server_hostname"] == "gpu.example"
    assert plain["ssl"] is None


async def test_a_connection_out_of_step_gives_its_place_in_the_pool_up(network: Network) -> None:
    """A connection that got an answer nobody asked for leaves the pool when its answer is
    closed, so a pool at its limit opens a new one rather than wait."""
    pool = h1_pool.Pool(1, 1.0)
    pending = request(pool)
    await settle()
    network.last.feed(fixed(b"a") + fixed(b"unasked"))
    first = await pending
    assert await first.read(1.0) == b"a"
    first.close()
    await settle()
    pending = request(pool)
    await settle()
    assert len(network.transports) == 2
    network.last.feed(fixed(b"b"))
    assert await (await pending).read(1.0) == b"b"


def test_a_header_with_a_line_break_is_refused() -> None:
    """A header value holding CR or LF is refused rather than sent (no header injection)."""
    with pytest.raises(ValueError, match="line break"):
        h1_pool._request_head("POST", "/", b"h", {"X-Tag": "a\r\nEvil: 1"}, 0)


# ------------------------------------------------------------------ the splice


async def client_connection() -> tuple[ClientStream, MockTransport]:
    """A prepared stream to the client over the gateway's own client-connection protocol, on
    a mock transport whose write buffer goes over its mark past 64 bytes and back under it
    when empty; the head is taken, so `written` holds the body only."""
    limits = ConnectionLimits(header_timeout=60.0, idle_timeout=60.0, max_open=8)
    connections = ClientConnections(limits, Metrics(CollectorRegistry()))
    protocol = connections.protocol_factory(asyncio.Protocol)()
    transport = connect(protocol, high=64, low=0)
    out = ClientStream({"Content-Type": "text/event-stream"}, write_timeout=10)
    await out.prepare(make_mocked_request("POST", "/v1/completions", transport=transport))
    assert out.send(b"")  # the head alone
    assert transport.written.startswith(b"HTTP/1.1 200 OK\r\n")
    transport.take()
    transport.written.clear()
    return out, transport


async def test_sse_events_go_from_the_instance_to_the_client_whole_and_chunk_framed() -> None:
    """Spliced events reach the client's transport whole, in HTTP/1.1 chunk framing, however
    the instance's bytes were split (the events of one read in one chunk); the end is clean
    and the connection goes back."""
    stream = b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n"
    for cut in range(1, len(stream)):
        conn, upstream, owner = opened()
        head = ask(conn)
        upstream.feed(CHUNKED_HEAD)
        response = head.result()
        out, client = await client_connection()
        run = splice.Splice(response, out, sse.Framer(), silence=10, write_timeout=10)
        run.start(out)
        upstream.feed(stream[:cut])
        client.take()  # the client keeps up
        upstream.feed(stream[cut:])
        payloads = dechunk(bytes(client.written))
        assert b"".join(payloads) == b"".join(EVENTS), cut
        assert all(p.endswith(b"\n\n") for p in payloads), cut  # whole events only
        assert len(payloads) <= 2, cut  # one write per read of the instance's socket
        assert run.done.result() == splice.End(splice.Why.ENDED)
        assert run.framer.done
        run.stop(out)
        response.close()
        assert owner.back == [conn]


async def test_a_client_over_its_high_water_mark_pauses_the_instance_until_it_drains() -> None:
    """When the client's transport reports its buffer high the instance's socket stops being
    read; when it drains below its low mark reading resumes and the stream goes on."""
    conn, upstream, _ = opened()
    head = ask(conn)
    upstream.feed(CHUNKED_HEAD)
    response = head.result()
    out, client = await client_connection()
    run = splice.Splice(response, out, sse.Framer(), silence=10, write_timeout=10)
    run.start(out)
    upstream.feed(chunk(EVENTS[0]))
    assert not upstream.reading_paused
    upstream.feed(chunk(b"data: " + b"z" * 80 + b"\n\n"))  # over the client's 64 bytes
    assert client.writing_paused
    assert upstream.reading_paused
    assert run.behind
    assert "behind=True" in repr(run)
    client.take(50)
    assert upstream.reading_paused  # not yet down to the low mark
    client.take()
    assert not upstream.reading_paused
    assert not run.behind
    upstream.feed(chunk(EVENTS[2]) + b"0\r\n\r\n")
    assert bytes(client.written).endswith(chunk(EVENTS[2]))
    assert run.done.result().why is splice.Why.ENDED
    assert upstream.pauses == 1


async def test_the_instance_breaking_mid_stream_ends_the_splice_with_why() -> None:
    """An instance that closes mid-stream ends the splice as ENDED with the break's reason,
    after the whole events that came before it reached the client."""
    conn, upstream, _ = opened()
    head = ask(conn)
    upstream.feed(CHUNKED_HEAD)
    response = head.result()
    out, client = await client_connection()
    run = splice.Splice(response, out, sse.Framer(), silence=10, write_timeout=10)
    run.start(out)
    upstream.feed(chunk(EVENTS[0]) + chunk(b"data: half"))
    upstream.feed_eof()
    end = await asyncio.wait_for(run.done, 1)
    assert end.why is splice.Why.ENDED
    assert end.broken is not None
    assert "broke the stream after it started" in end.broken
    assert bytes(client.written) == chunk(EVENTS[0])


async def test_a_client_that_left_ends_the_splice_and_drops_the_instance() -> None:
    """Once the client's transport is closing, the next event ends the splice as the client's
    doing, nothing more is written, and closing the answer drops the instance's connection."""
    conn, upstream, owner = opened()
    head = ask(conn)
    upstream.feed(CHUNKED_HEAD)
    response = head.result()
    out, client = await client_connection()
    run = splice.Splice(response, out, sse.Framer(), silence=10, write_timeout=10)
    run.start(out)
    client.close()
    upstream.feed(chunk(EVENTS[0]))
    assert run.done.result().why is splice.Why.CLIENT
    assert client.written == b""
    response.close()
    assert upstream.aborted
    assert owner.back == []


# ------------------------------------------------------------------ cancellation at every await
# httpcore's tests/test_cancellations.py is the model: a request cancelled wherever it waits
# leaves the pool with no place lost and no half-used connection kept.


async def _next_request_is_served(pool: h1_pool.Pool, network: Network) -> None:
    pending = request(pool)
    await settle()
    network.last.feed(fixed(b"next"))
    response = await asyncio.wait_for(pending, 1.0)
    assert await response.read(1.0) == b"next"
    response.close()


async def test_cancelled_while_waiting_for_a_place(network: Network) -> None:
    """A waiter for the one place leaves: the holder's place goes to the next request."""
    pool = h1_pool.Pool(1, 1.0)
    holder = request(pool)
    await settle()
    waiter = request(pool)
    await settle()
    waiter.cancel()
    await settle()
    network.last.feed(fixed(b"held"))
    response = await holder
    assert await response.read(1.0) == b"held"
    response.close()
    await _next_request_is_served(pool, network)
    assert "open=1/1 idle=1" in repr(pool)


async def test_cancelled_while_connecting(network: Network) -> None:
    """A connect in progress, cancelled: its place is free, nothing is counted open."""
    pool = h1_pool.Pool(1, 1.0)
    network.gate = asyncio.Event()
    pending = request(pool)
    await settle()
    pending.cancel()
    await settle()
    assert "open=0/1" in repr(pool)
    network.gate = None
    await _next_request_is_served(pool, network)


async def test_cancelled_while_waiting_for_the_head(network: Network) -> None:
    """The request went out, no head yet: the connection is aborted (the instance sees us
    leave) and not kept; the next request gets a new one."""
    pool = h1_pool.Pool(1, 1.0)
    pending = request(pool)
    await settle()
    first = network.last
    pending.cancel()
    await settle()
    assert first.aborted
    await _next_request_is_served(pool, network)
    assert network.last is not first


async def test_cancelled_while_reading_the_body(network: Network) -> None:
    """The head came, the body is being read: closing the answer unfinished aborts the
    connection; the place is free for the next request on a new one."""
    pool = h1_pool.Pool(1, 1.0)
    pending = request(pool)
    await settle()
    first = network.last
    first.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nsome")
    response = await pending
    reading = asyncio.ensure_future(response.read(1.0))
    await settle()
    reading.cancel()
    await settle()
    response.close()
    await settle()
    assert first.aborted
    await _next_request_is_served(pool, network)
    assert network.last is not first


async def test_a_kept_alive_connection_keeps_one_timer_across_requests() -> None:
    """Request after request on one connection moves only the phase's deadline: the timer
    armed at accept stays (re-armed when it fires, not twice a request), and the idle
    deadline still ends the connection."""
    limits = ConnectionLimits(header_timeout=0.05, idle_timeout=0.1, max_open=8)
    connections = ClientConnections(limits, Metrics(CollectorRegistry()))
    protocol = connections.protocol_factory(asyncio.Protocol)()
    transport = connect(protocol)
    conn = cast(Any, protocol)
    timer = conn._timer
    for _ in range(3):
        protocol.data_received(b"G")
        conn.request_started()
        conn.request_finished(True)
    assert conn._timer is timer
    await asyncio.sleep(0.3)
    assert transport.closed
