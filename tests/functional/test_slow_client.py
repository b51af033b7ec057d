"""A client that stops reading is let go after `timeout.write`, freeing its instance."""

from __future__ import annotations

import asyncio
import json
import socket

from fakes import KEY, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig


async def test_client_that_stops_reading_is_dropped_after_the_write_timeout() -> None:
    """A stalled reader gets dropped once its backlog waited `timeout.write` s; in-flight -> 0."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims, channel={"timeout": {"connect": 2, "read": 10, "write": 0.5}}) as gw,
    ):
        host, port = gw.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        body = json.dumps(
            {"prompt": "x", "max_tokens": 30000, "stream": True, "model": "sim-model"}
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        await asyncio.get_running_loop().sock_sendall(sock, head + body)
        try:
            async with asyncio.timeout(10):
                while gw.metrics.stream_aborts.labels("client")._value.get() < 1:
                    await asyncio.sleep(0.05)
                while gw.dispatcher.scheduler.inflight:
                    await asyncio.sleep(0.05)
        finally:
            sock.close()
