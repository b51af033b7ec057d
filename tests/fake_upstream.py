"""A fake of `upstream/client.py`'s seam: scripted answers replayed read by read, no sockets.

httpcore's mock backend is the model: a response is the list of what the instance sends,
handed back one `next_chunk()` at a time. An item is bytes (one read, however it splits
the events), a `Pause` (the instance goes quiet that long), or an `AttemptFailed` (the
connection breaks there). Like connection.py's answer, a `FakeResponse` can also be
spliced: from `splice(sink)` on, a task of its own pushes the items left to the sink, and
`pause_reading()` holds that task until `resume_reading()`. `FakeUpstream` answers each
`open()` with the next scripted response, or raises the next scripted
`AttemptFailed`, and keeps what was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.upstream.connection import Sink
from gateway.upstream.response import MAX_WHOLE_BYTES, AttemptFailed, read_whole


@dataclass(frozen=True)
class Pause:
    """The instance sends nothing for `seconds`."""

    seconds: float


Item = bytes | Pause | AttemptFailed


class FakeResponse:
    """An `UpstreamResponse` that replays `items`; it records how it was read and let go."""

    def __init__(
        self,
        status: int = 200,
        items: Iterable[Item] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict(headers or {}))
        self._items: deque[Item] = deque(items)
        self.reads = 0  # non-empty chunks handed out
        self.closed = False
        self.pauses = 0  # pause_reading() calls while spliced
        self._reading = asyncio.Event()
        self._reading.set()
        self._pusher: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()

    @property
    def content_type(self) -> str:
        raw = self.headers.get("Content-Type", "application/octet-stream")
        return raw.split(";", 1)[0].strip().lower()

    async def read(self, timeout: float, limit: int = MAX_WHOLE_BYTES) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                parts = []
                while chunk := await self._next():
                    parts.append(chunk)
                    if sum(map(len, parts)) > limit:
                        raise AttemptFailed("bad_response", f"body over {limit} bytes")
                return b"".join(parts)
        except TimeoutError:
            raise AttemptFailed("timeout", f"body not read within {timeout:.1f}s") from None

    @property
    def fully_read(self) -> bool:
        """Nothing is left to replay: the next read would be the clean end."""
        return not self._items

    async def next_chunk(self, timeout: float | None = None) -> bytes:
        if timeout is None:
            return await self._next()
        try:
            async with asyncio.timeout(timeout):
                return await self._next()
        except TimeoutError:
            raise AttemptFailed("timeout", f"no bytes within {timeout:.1f}s") from None

    async def _next(self) -> bytes:
        while self._items:
            if self.closed:  # as connection.py's: a reader still waiting is told it broke
                raise AttemptFailed("connect", "closed by the gateway before it ended")
            item = self._items.popleft()
            if isinstance(item, Pause):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(item.seconds):
                        await self._closing.wait()
            elif isinstance(item, AttemptFailed):
                raise item
            elif item:
                self.reads += 1
                return item
        return b""

    def splice(self, sink: Sink) -> None:
        """Push the items left to `sink` from a task, as connection.py's data_received would."""
        self._pusher = asyncio.get_running_loop().create_task(self._push(sink))

    async def _push(self, sink: Sink) -> None:
        while True:
            await self._reading.wait()
            try:
                data = await self._next()
            except AttemptFailed as failed:  # worded as connection.py words a broken body
                sink.ended(f"broke the stream after it started ({failed.detail})")
                return
            if not data:
                sink.ended(None)
                return
            sink.body(data)

    def pause_reading(self) -> None:
        self.pauses += 1
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    def close(self) -> None:
        self.closed = True
        self._closing.set()
        if self._pusher is not None:
            self._pusher.cancel()  # the instance sees its client leave

    def __repr__(self) -> str:
        spliced = " spliced" if self._pusher is not None else ""
        return f"<FakeResponse status={self.status} left={len(self._items)}{spliced}>"


@dataclass(frozen=True)
class Sent:
    """One request as the fake upstream received it."""

    method: str
    url: str
    body: bytes | None
    headers: dict[str, str]
    timeout: float


class FakeUpstream:
    """`Upstream` with scripted answers, one per `open()`, in order."""

    def __init__(self, *answers: FakeResponse | AttemptFailed) -> None:
        self.answers: deque[FakeResponse | AttemptFailed] = deque(answers)
        self.sent: list[Sent] = []

    async def open(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
    ) -> FakeResponse:
        self.sent.append(Sent(method, url, body, dict(headers), timeout))
        if not self.answers:
            raise AssertionError(f"no scripted answer left for {method} {url}")
        answer = self.answers.popleft()
        if isinstance(answer, AttemptFailed):
            raise answer
        return answer

    async def fetch(
        self,
        url: str,
        *,
        method: str = "GET",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float,
    ) -> tuple[int, bytes]:
        """As the real one (open, read whole, release), on the scripted answers."""
        response = await self.open(method, url, body=body, headers=headers or {}, timeout=timeout)
        return await read_whole(response, timeout)

    def __repr__(self) -> str:
        return f"<FakeUpstream sent={len(self.sent)} left={len(self.answers)}>"
