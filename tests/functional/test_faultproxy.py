"""The fault proxy itself (tests/faultproxy.py): forwarding, latency, trickling, resets,
refusal and hanging, against a plain echo server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from faultproxy import FaultProxy, eventually

# ---------------------------------------------------------------- the fault proxy itself


@contextlib.asynccontextmanager
async def _echo_server() -> AsyncIterator[int]:
    """An upstream that answers each chunk it reads with that chunk repeated 100 times."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1024):
                writer.write(data * 100)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def _exchange(proxy: FaultProxy, payload: bytes, want: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(payload)
        await writer.drain()
        return await reader.readexactly(want)
    finally:
        writer.close()


async def test_fault_proxy_forwards_and_adds_latency_and_trickles() -> None:
    """The proxy forwards both ways, adds latency per direction and throttles to a byte rate."""
    async with _echo_server() as port, FaultProxy(port) as proxy:
        assert await _exchange(proxy, b"ab", 200) == b"ab" * 100
        proxy.latency_up = proxy.latency_down = 0.15
        started = time.monotonic()
        await _exchange(proxy, b"ab", 200)
        assert time.monotonic() - started >= 0.3
        proxy.latency_up = proxy.latency_down = 0.0
        proxy.trickle_bytes_per_s = 1000
        started = time.monotonic()
        await _exchange(proxy, b"abcd", 400)  # 400 bytes at 1000 B/s: 7 ticks of 50 ms
        assert time.monotonic() - started >= 0.3
        await eventually(lambda: len(proxy.open_connections()) == 0, timeout=1.0)
        assert proxy.seen == 3
        assert all(c.client_closed_at is not None for c in proxy.connections)


async def test_fault_proxy_resets_refuses_and_restores() -> None:
    """The proxy resets after N answer bytes, refuses while down, and serves again once restored."""
    async with _echo_server() as port, FaultProxy(port) as proxy:
        proxy.reset_after_bytes = 50
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)) as info:
            await _exchange(proxy, b"ab", 200)
        if isinstance(info.value, asyncio.IncompleteReadError):
            assert len(info.value.partial) <= 50
        assert proxy.connections[-1].reset
        proxy.reset_after_bytes = None
        await proxy.refuse()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", proxy.port)
        await proxy.restore()
        assert await _exchange(proxy, b"z", 100) == b"z" * 100
        proxy.hang = True
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await _exchange(proxy, b"q", 100)
        await eventually(lambda: proxy.connections[-1].client_closed_at is not None, timeout=1.0)
        assert proxy.connections[-1].hung
