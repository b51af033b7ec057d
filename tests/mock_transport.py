"""A stream transport with no socket under it, for testing protocols bytes in, bytes out.

As uvicorn tests its protocols: the test feeds the peer's bytes straight into the
protocol's `data_received`, and reads back what the protocol wrote. `MockTransport`
records every write, reading paused and resumed, and close or abort; like asyncio's own
transports it tells its protocol `connection_lost` on the loop's next pass after a close,
and `pause_writing`/`resume_writing` when its write buffer (the bytes the peer has not
taken yet) goes over its high-water mark and back to its low one. `Network` stands in for
`loop.create_connection`, handing out one `MockTransport` per connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class MockTransport(asyncio.Transport):
    """One connection's transport: what was written, whether reading is paused, if closed."""

    def __init__(
        self, protocol: asyncio.Protocol | None = None, *, high: int = 64 * 1024, low: int = 0
    ) -> None:
        super().__init__()
        self.protocol = protocol
        self.written = bytearray()  # every byte written, in order
        self.buffered = 0  # written and not yet taken by the peer (`take`)
        self.high, self.low = high, low
        self.writing_paused = False  # the protocol was told pause_writing
        self.reading_paused = False
        self.pauses = 0  # pause_reading calls that paused
        self.closed = False
        self.aborted = False
        self.eof_written = False

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else "closed" if self.closed else "open"
        return (
            f"<MockTransport {state} written={len(self.written)} buffered={self.buffered} "
            f"reading_paused={self.reading_paused}>"
        )

    # ---------------------------------------------------------- what the protocol calls

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000)}.get(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written += data
        self.buffered += len(data)
        if self.buffered > self.high and not self.writing_paused and self.protocol is not None:
            self.writing_paused = True
            self.protocol.pause_writing()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = 64 * 1024 if high is None else high
        self.low = self.high // 4 if low is None else low

    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.pauses += 1

    def resume_reading(self) -> None:
        self.reading_paused = False

    def is_reading(self) -> bool:
        return not self.reading_paused and not self.closed

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self._close()

    def abort(self) -> None:
        self.aborted = True
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.protocol is not None:
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    # ---------------------------------------------------------- what the test does as the peer

    def feed(self, data: bytes) -> None:
        """The peer's bytes arrive (a protocol that paused reading gets none)."""
        assert self.protocol is not None
        assert not self.reading_paused, "fed while reading is paused"
        assert not self.closed, "fed after close"
        self.protocol.data_received(data)

    def feed_eof(self) -> None:
        """The peer half-closes: the protocol hears EOF and, unless it keeps it open, the
        transport closes."""
        assert self.protocol is not None
        if not self.protocol.eof_received():
            self.close()

    def lose(self, exc: Exception | None) -> None:
        """The connection breaks under the protocol (a reset): it hears so at once."""
        assert self.protocol is not None
        self.closed = True
        self.protocol.connection_lost(exc)

    def take(self, count: int | None = None) -> bytes:
        """The peer reads `count` buffered bytes (all by default): under the low-water mark
        the protocol is told it may write again."""
        count = self.buffered if count is None else min(count, self.buffered)
        start = len(self.written) - self.buffered
        self.buffered -= count
        if self.writing_paused and self.buffered <= self.low and self.protocol is not None:
            self.writing_paused = False
            self.protocol.resume_writing()
        return bytes(self.written[start : start + count])


def connect(protocol: asyncio.Protocol, **limits: int) -> MockTransport:
    """A transport made for `protocol` and handed to its `connection_made`."""
    transport = MockTransport(protocol, **limits)
    protocol.connection_made(transport)
    return transport


class Network:
    """`loop.create_connection` without sockets: each connection gets a `MockTransport`."""

    def __init__(self) -> None:
        self.transports: list[MockTransport] = []
        self.refuse: OSError | None = None  # raised instead of connecting, when set
        self.made = asyncio.Event()  # set on each connection made; the test clears it
        self.gate: asyncio.Event | None = None  # when set, a connect waits for it (in progress)
        self.connects: list[tuple[str, int, dict[str, Any]]] = []  # each connect's arguments

    async def create_connection(
        self, factory: Callable[[], asyncio.Protocol], host: str, port: int, **options: Any
    ) -> tuple[MockTransport, asyncio.Protocol]:
        self.connects.append((host, port, options))
        if self.refuse is not None:
            raise self.refuse
        if self.gate is not None:
            await self.gate.wait()
        protocol = factory()
        transport = connect(protocol)
        self.transports.append(transport)
        self.made.set()
        return transport, protocol

    @property
    def last(self) -> MockTransport:
        return self.transports[-1]
