"""The spliced relay (splice.py) through a real gateway: flow control both ways, a client
that leaves, and an error after the commit, each as a client on a raw socket sees it."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from fakes import KEY, Gateway, fleet, gateway_with
from faultproxy import eventually
from test_upstream_misbehaves import ROLE, instance, start_stream, token

from gateway.server.resources import PROXY
from gateway.sim.sim_vllm import SimConfig

BIG = 400  # events of 8 KiB: 3.2 MB, far more than the client's buffers hold


def big_event(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%d%s"}}]}\n\n' % (i, b"x" * 8192)


def pool(gw: Gateway) -> str:
    streams = gw.app[PROXY].upstream.pool
    return repr(streams)


def busy(gw: Gateway) -> int:
    """Connections open and not idle: the streams' (probes and scrapes share the pool)."""
    found = re.search(r"open=(\d+)/\d+ idle=(\d+)", pool(gw))
    assert found is not None
    return int(found[1]) - int(found[2])


def request_bytes(gw: Gateway, body: dict[str, Any]) -> bytes:
    host = gw.url.removeprefix("http://")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


async def raw_client(gw: Gateway) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return sock


async def read_to_end(sock: socket.socket, marker: bytes = b"\r\n0\r\n\r\n") -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while not got.endswith(marker):
        data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
        if not data:
            break
        got += data
    return bytes(got)


async def test_a_client_behind_pauses_the_instance_read_and_then_gets_every_event() -> None:
    """While the client does not read, the gateway stops reading the instance's socket
    (so what it holds for the client stays bounded); once the client reads again every
    event arrives, in order."""
    written = [0]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        for i in range(BIG):
            await resp.write(big_event(i))
            written[0] += 1
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with instance(handler, channel={"timeout": {"write": 10}}) as gw:
        sock = await raw_client(gw)
        try:
            await asyncio.get_running_loop().sock_sendall(
                sock, request_bytes(gw, {"messages": [], "stream": True})
            )
            await eventually(lambda: "paused=1" in pool(gw), 5, "the instance's read paused")
            await asyncio.sleep(0.3)
            # It stays paused while the client does not read. (Whether the instance's own
            # writes stall too depends on how much the kernel buffers on loopback.)
            assert "paused=1" in pool(gw)
            raw = await read_to_end(sock)
        finally:
            sock.close()
        events = [e for e in raw.split(b"\n\n") if b"data: " in e]
        contents = [e for e in events if b'"content":"' in e]
        assert len(contents) == BIG
        assert [int(e.split(b'"content":"')[1].split(b"x")[0]) for e in contents] == list(
            range(BIG)
        )
        assert events[-1].endswith(b"data: [DONE]")
        assert written[0] == BIG
        assert "paused=0" in pool(gw)


async def test_a_client_that_leaves_closes_the_instance_connection_at_once() -> None:
    """A client that closes mid-stream makes the gateway close the instance's connection
    right away: the instance cancels the request unfinished, the slot is free again, and
    the access line says the client cut it."""
    paced = SimConfig(decode_s_per_token=0.002, prefill_tokens_per_s=1e6)
    with structlog.testing.capture_logs() as events:
        async with fleet(paced) as sims, gateway_with(sims) as gw:
            sim = sims[0]
            body = {
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
                "max_tokens": 5000,
            }
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    gw.base_url + "/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {KEY}"},
                ) as resp,
            ):
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")
                assert busy(gw) == 1
            # Leaving the block closed the client's connection with the stream unread.
            took = await eventually(lambda: sim.stats.cancelled == 1, 3, "the instance cancelled")
            assert took < 1.0
            await eventually(lambda: gw.dispatcher.snapshot().inflight == 0, 2, "in-flight 0")
            assert sim.stats.completed == 0
            assert gw.metrics.stream_aborts.labels("client")._value.get() == 1
            await eventually(lambda: any(e["event"] == "request" for e in events), 2, "logged")
    line = next(e for e in events if e["event"] == "request")
    assert (line["status"], line["cut"]) == (499, "client")


async def test_an_error_after_the_commit_is_one_whole_event_after_whole_events() -> None:
    """An instance that breaks its stream mid-event: the client gets the whole events before
    it, not the half one, then one whole error event and `[DONE]`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        await resp.write(ROLE + token(0))
        await asyncio.sleep(0.05)  # spliced by now: the rest goes through splice.py
        await resp.write(token(1) + b'data: {"choices":[{"delta":{"cont')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # the connection breaks mid-event
        return resp

    async with instance(handler) as gw:
        sock = await raw_client(gw)
        try:
            await asyncio.get_running_loop().sock_sendall(
                sock, request_bytes(gw, {"messages": [], "stream": True})
            )
            raw = await read_to_end(sock)
        finally:
            sock.close()
        body = _unchunk(raw.split(b"\r\n\r\n", 1)[1])
        events = body.split(b"\n\n")
        assert events[-1] == b""
        assert events[-2] == b"data: [DONE]"
        payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        assert [p["choices"][0]["delta"].get("content") for p in payloads[:3]] == ["", "t0 ", "t1 "]
        assert len(payloads) == 4
        error = payloads[3]["error"]
        assert "broke the stream after it started" in error["message"]
        assert error["code"] == 502
        assert b'"cont' not in body.split(b"t1 ")[1].split(b"error")[0]
        assert busy(gw) == 0  # the broken stream's connection went, not back to the pool


def _unchunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked answer."""
    out = bytearray()
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out += rest[:n]
        data = rest[n + 2 :]
    return bytes(out)
