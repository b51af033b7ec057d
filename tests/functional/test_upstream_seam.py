"""The network seam's contract, against a real server on loopback.

`Upstream.open` returns our `UpstreamResponse`, and every failure of the connection
surfaces as `AttemptFailed` with the kind the retry policy reads: no transport's own
exception reaches the caller. `tests/fake_upstream.py` stands in for this in cheap tests, so these
pin what it imitates.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway.config.schema import Timeouts
from gateway.upstream.client import Upstream
from gateway.upstream.response import AttemptFailed


async def _chunks(request: web.Request) -> web.StreamResponse:
    """Three chunks 20 ms apart; with ?cut=1 the connection drops after the second."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await out.prepare(request)
    for i in range(3):
        if i == 2 and request.query.get("cut"):
            assert request.transport is not None
            request.transport.close()  # mid-body: the chunked encoding never ends
            return out
        await out.write(b"data: %d\n\n" % i)
        await asyncio.sleep(0.02)
    await out.write_eof()
    return out


async def _slow(request: web.Request) -> web.StreamResponse:
    """A head at once, then a body that takes a second."""
    out = web.StreamResponse()
    out.content_length = 4
    await out.prepare(request)
    await out.write(b"ab")
    await asyncio.sleep(1.0)
    await out.write(b"cd")
    return out


async def _hang(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(10)
    return web.Response()


async def _plain(request: web.Request) -> web.Response:
    return web.json_response({"ok": True}, status=503, headers={"Retry-After": "2"})


@contextlib.asynccontextmanager
async def server_and_upstream() -> AsyncIterator[tuple[str, Upstream]]:
    app = web.Application()
    app.router.add_get("/chunks", _chunks)
    app.router.add_get("/slow", _slow)
    app.router.add_get("/hang", _hang)
    app.router.add_get("/plain", _plain)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    upstream = Upstream(4, Timeouts(connect=1.0))
    await upstream.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", upstream
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_a_whole_answer_comes_back_as_our_response() -> None:
    """Status, headers (any case) and content type are read; the body arrives whole."""
    async with server_and_upstream() as (url, upstream):
        response = await upstream.open("GET", url + "/plain", body=None, headers={}, timeout=1)
        try:
            assert response.status == 503
            assert response.headers["retry-after"] == "2"
            assert response.content_type == "application/json"
            assert await response.read(1.0) == b'{"ok": true}'
        finally:
            response.close()
            response.close()  # idempotent


async def test_a_body_cut_off_mid_way_is_a_connect_failure() -> None:
    """A connection dropped inside a chunked body raises AttemptFailed("connect")."""
    async with server_and_upstream() as (url, upstream):
        response = await upstream.open(
            "GET", url + "/chunks?cut=1", body=None, headers={}, timeout=1
        )
        with pytest.raises(AttemptFailed) as failed:
            await response.read(1.0)
        assert failed.value.kind == "connect"
        response.close()


async def test_a_body_slower_than_its_time_is_a_timeout() -> None:
    """read() raises AttemptFailed("timeout") when its time runs out."""
    async with server_and_upstream() as (url, upstream):
        response = await upstream.open("GET", url + "/slow", body=None, headers={}, timeout=1)
        with pytest.raises(AttemptFailed) as failed:
            await response.read(0.05)
        assert failed.value.kind == "timeout"
        response.close()


async def test_no_head_in_time_is_a_timeout_and_a_refused_port_a_connect_failure() -> None:
    """open() maps a silent instance to "timeout" and a closed port to "connect"."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    async with server_and_upstream() as (url, upstream):
        with pytest.raises(AttemptFailed) as failed:
            await upstream.open("GET", url + "/hang", body=None, headers={}, timeout=0.05)
        assert failed.value.kind == "timeout"
        with pytest.raises(AttemptFailed) as failed:
            await upstream.open(
                "GET", f"http://127.0.0.1:{closed_port}/", body=None, headers={}, timeout=1
            )
        assert failed.value.kind == "connect"
        assert await upstream.fetch(url + "/plain", timeout=1.0) == (503, b'{"ok": true}')


async def test_an_unpooled_upstream_closes_each_connection() -> None:
    """pooled=False (the worker metrics scrape) keeps no connection after an exchange."""
    async with server_and_upstream() as (url, _):
        upstream = Upstream(4, Timeouts(connect=1.0), pooled=False)
        await upstream.start()
        try:
            assert (await upstream.fetch(url + "/plain", timeout=1.0))[0] == 503
            await asyncio.sleep(0.05)  # the pool's reaper runs at once for keepalive 0
            assert "open=0/4 idle=0" in repr(upstream)
        finally:
            await upstream.close()
        assert repr(upstream) == "<Upstream None>"
