"""Bounded client connections, over raw sockets: slow heads, slow bodies, idle keep-alive,
the connection cap, and `Expect: 100-continue` checked before the body is invited.

Timeouts are fractions of a second so each case takes about one; every assertion that a
connection was cut also waits for the end of its stream, so a connection left open fails
by its read deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client import generate_latest

from gateway.sim.sim_vllm import SimConfig

SHORT = 0.3  # every timeout under test
DEADLINE = 3.0  # how long a test waits for what SHORT should cause
GOOD_BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture
async def gw(request: pytest.FixtureRequest) -> AsyncIterator[Gateway]:
    settings = {
        "header_timeout": SHORT,
        "body_timeout": SHORT,
        "idle_timeout": SHORT,
        "max_body_bytes": 4096,
        **getattr(request, "param", {}),
    }
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(
            sims, sections={"gateway": settings, "dispatch": {"health_check_interval": 60}}
        ) as gw,
    ):
        yield gw


class Client:
    """One raw TCP connection to the gateway."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, gw: Gateway) -> Client:
        host, port = gw.url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> tuple[int, dict[str, str], bytes]:
        """The next answer's status, headers (lower-cased names) and body."""
        async with asyncio.timeout(DEADLINE):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            body = await self.reader.readexactly(int(headers.get("content-length", 0)))
        return int(lines[0].split()[1]), headers, body

    async def closed(self) -> bytes:
        """Waits for the gateway to close the connection; returns what came before the end."""
        async with asyncio.timeout(DEADLINE):
            return await self.reader.read()

    def close(self) -> None:
        self.writer.close()


def head(path: str = "/v1/chat/completions", *extra: str, method: str = "POST") -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Authorization: Bearer {KEY}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


HEALTHZ = head("/healthz", method="GET")


def openai_error(body: bytes, code: str) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    return dict(error)


def counted(gw: Gateway, name: str, labels: str = "") -> float:
    """The value of one series in the gateway's /metrics text."""
    text = generate_latest(gw.metrics.registry).decode()
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == wanted:
            return float(value)
    raise AssertionError(f"no series {wanted} in /metrics")


def cuts(gw: Gateway, reason: str) -> float:
    return counted(gw, "gateway_client_connections_closed_total", f'reason="{reason}"')


# ---------------------------------------------------------------- the request head


async def test_slowloris_head_gets_408_and_is_closed(gw: Gateway) -> None:
    """A head that trickles in one line at a time gets 408 at header_timeout, then the end."""
    client = await Client.open(gw)

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):  # the gateway hangs up: done
            await client.send(b"POST /v1/chat/completions HTTP/1.1\r\n")
            for i in range(int(DEADLINE / 0.1)):
                await client.send(b"X-Slow-%d: 1\r\n" % i)
                await asyncio.sleep(0.1)

    sender = asyncio.create_task(trickle())
    try:
        status, headers, body = await client.answer()
        assert status == 408
        assert headers["connection"] == "close"
        openai_error(body, "request_timeout")
        assert await client.closed() == b""
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        client.close()
    assert cuts(gw, "header_timeout") == 1


async def test_many_slow_heads_are_all_cut(gw: Gateway) -> None:
    """Twenty connections holding half a head each are all closed, none left open."""
    clients = []
    try:
        for _ in range(20):  # each sends its half head at once: its timer runs from connect
            clients.append(client := await Client.open(gw))
            await client.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        answers = await asyncio.gather(*(c.answer() for c in clients))
        assert [status for status, _, _ in answers] == [408] * 20
        assert await asyncio.gather(*(c.closed() for c in clients)) == [b""] * 20
    finally:
        for client in clients:
            client.close()
    assert cuts(gw, "header_timeout") == 20
    assert counted(gw, "gateway_client_connections") == 0


async def test_connection_that_says_nothing_is_closed_silently(gw: Gateway) -> None:
    """A connection that never sends a byte is closed at header_timeout with no answer."""
    client = await Client.open(gw)
    try:
        assert await client.closed() == b""
    finally:
        client.close()
    assert cuts(gw, "header_timeout") == 1


# ---------------------------------------------------------------- the body


async def test_slow_body_gets_408_and_is_closed(gw: Gateway) -> None:
    """A body announced at 4000 bytes of which 12 arrive gets 408 at body_timeout, then the end."""
    client = await Client.open(gw)
    try:
        await client.send(head("/v1/chat/completions", "Content-Length: 4000") + b'{"messages":')
        status, headers, body = await client.answer()
        assert status == 408
        assert headers["connection"] == "close"
        assert "body_timeout" in openai_error(body, "request_timeout")["message"]
        assert await client.closed() == b""
    finally:
        client.close()
    assert cuts(gw, "body_timeout") == 1
    assert sum(s.stats.requests for s in gw.sims) == 0


async def test_refusal_before_the_body_closes_rather_than_lingering(gw: Gateway) -> None:
    """A 401 sent before the body arrived says close and ends soon, not after aiohttp's 10 s."""
    client = await Client.open(gw)
    try:
        wrong_key = head("/v1/chat/completions", "Content-Length: 4000").replace(
            KEY.encode(), b"sk-wrong"
        )
        await client.send(wrong_key + b'{"messages":')
        status, headers, body = await client.answer()
        assert status == 401
        assert headers["connection"] == "close"
        openai_error(body, "invalid_api_key")
        assert await client.closed() == b""
    finally:
        client.close()
    assert cuts(gw, "header_timeout") == 0


# ---------------------------------------------------------------- keep-alive


async def test_idle_keep_alive_connection_is_closed_after_idle_timeout(gw: Gateway) -> None:
    """A kept-alive connection is reused within idle_timeout and closed once idle longer."""
    client = await Client.open(gw)
    try:
        for _ in range(3):  # each request comes before the idle timeout runs out
            await client.send(HEALTHZ)
            status, headers, _ = await client.answer()
            assert status == 200
            assert headers.get("connection", "keep-alive").lower() == "keep-alive"
            await asyncio.sleep(SHORT / 3)
        assert await client.closed() == b""
    finally:
        client.close()
    assert cuts(gw, "idle_timeout") == 1
    assert cuts(gw, "header_timeout") == 0


async def test_a_long_answer_is_never_cut_by_the_connection_timers() -> None:
    """A stream lasting many header and idle timeouts runs to its end on one connection."""
    sim = SimConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1e6)
    timeouts = {"header_timeout": 0.1, "idle_timeout": 0.1, "body_timeout": 0.1}
    async with fleet(sim) as sims, gateway_with(sims, sections={"gateway": timeouts}) as gw:
        client = await Client.open(gw)
        try:
            body = json.dumps(
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
            ).encode()
            await client.send(head("/v1/chat/completions", f"Content-Length: {len(body)}") + body)
            status, _, data = await client.answer()  # buffered: ~1 s of decoding
            assert status == 200, data
            assert json.loads(data)["usage"]["completion_tokens"] == 20
        finally:
            client.close()
        assert sum(cuts(gw, r) for r in ("header_timeout", "idle_timeout", "body_timeout")) == 0


# ---------------------------------------------------------------- the cap


@pytest.mark.parametrize("gw", [{"max_client_connections": 2, "header_timeout": 10}], indirect=True)
async def test_connections_over_the_cap_get_503_and_the_gauge_counts(gw: Gateway) -> None:
    """With 2 open, a third connection gets 503 with Retry-After at once; one leaving makes room."""
    held = [await Client.open(gw) for _ in range(2)]
    try:
        await held[0].send(HEALTHZ)
        assert (await held[0].answer())[0] == 200  # both are served connections
        assert counted(gw, "gateway_client_connections") == 2
        extra = await Client.open(gw)
        try:
            await extra.send(HEALTHZ)
            status, headers, body = await extra.answer()
            assert status == 503
            assert headers["retry-after"] == "1"
            assert headers["connection"] == "close"
            openai_error(body, "too_many_connections")
            assert await extra.closed() == b""
        finally:
            extra.close()
        assert cuts(gw, "over_limit") == 1
        held.pop().close()
        for _ in range(int(DEADLINE / 0.01)):
            if counted(gw, "gateway_client_connections") == 1:
                break
            await asyncio.sleep(0.01)
        again = await Client.open(gw)
        try:
            await again.send(HEALTHZ)
            assert (await again.answer())[0] == 200
        finally:
            again.close()
    finally:
        for client in held:
            client.close()


async def test_every_cut_reason_and_the_gauge_exist_at_zero(gw: Gateway) -> None:
    """The connection series are in /metrics at 0 before anything happened."""
    for reason in ("header_timeout", "body_timeout", "idle_timeout", "over_limit"):
        assert cuts(gw, reason) == 0
    assert counted(gw, "gateway_client_connections") == 0


# ---------------------------------------------------------------- Expect: 100-continue


def expecting(length: int, key: str = KEY) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()


@pytest.mark.parametrize(
    ("request_head", "status", "code"),
    [
        (expecting(len(GOOD_BODY), key="sk-wrong"), 401, "invalid_api_key"),
        (expecting(10**9), 413, "request_too_large"),
    ],
    ids=["wrong-key", "too-large"],
)
async def test_expect_continue_refuses_before_inviting_the_body(
    gw: Gateway, request_head: bytes, status: int, code: str
) -> None:
    """A request the gateway will refuse gets its 401 or 413 instead of `100 Continue`."""
    client = await Client.open(gw)
    try:
        await client.send(request_head)
        got, headers, body = await client.answer()
        assert got == status
        assert headers["connection"] == "close"
        assert len(headers["x-request-id"]) == 32
        openai_error(body, code)
        assert await client.closed() == b""
    finally:
        client.close()
    assert sum(s.stats.requests for s in gw.sims) == 0


async def test_expect_continue_invites_a_good_request_then_answers_it(gw: Gateway) -> None:
    """A good request gets `100 Continue`, sends its body, and gets the normal answer."""
    client = await Client.open(gw)
    try:
        await client.send(expecting(len(GOOD_BODY)))
        status, _, _ = await client.answer()
        assert status == 100
        await client.send(GOOD_BODY)
        status, _, body = await client.answer()
        assert status == 200, body
        assert json.loads(body)["object"] == "chat.completion"
    finally:
        client.close()


def test_the_bounds_hold_under_uvloop() -> None:
    """Under uvloop, what `gateway` serves with, a slow head still gets 408 and is counted."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        timeouts = {"header_timeout": SHORT, "idle_timeout": SHORT}
        async with (
            fleet(SimConfig(instant=True)) as sims,
            gateway_with(sims, sections={"gateway": timeouts}) as gw,
        ):
            client = await Client.open(gw)
            try:
                await client.send(b"GET /healthz HTTP/1.1\r\n")
                assert (await client.answer())[0] == 408
                assert await client.closed() == b""
            finally:
                client.close()
            assert cuts(gw, "header_timeout") == 1

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
