"""Listening to each instance's KV cache events: a ZMQ subscriber per instance.

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ...}'`
publishes every engine step's block changes on a PUB socket: three frames, the topic, the
sequence number (8 bytes, big-endian) and the batch (kv_wire.py). Its ROUTER socket at
`replay_endpoint` sends the batches it still holds from a sequence number on, then -1.

Each listener feeds its instance's index (dispatch/kv_index.py), which decides what a
sequence number means; here is only the I/O. A gap is replayed at once; what the replay
cannot bring leaves the index partial. Between messages the listener wakes a few times a
second to ask the index whether events owed have stopped coming (`KvIndex.check`, one
health interval of grace).

Every worker and every replica listens for itself (a PUB socket serves any number of
subscribers), so the index needs no shared store. ZMQ reconnects on its own: an instance
that restarts is heard again, and its sequence starting over at 0 tells the index.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from gateway.dispatch.kv_index import KvIndex
from gateway.fleet.kv_wire import BadPayload, decode_batch

log = structlog.get_logger("gateway.kv_events")

_END = -1  # the replay's last frame's sequence number
_REPLAY_TIMEOUT = 1.0  # seconds a replay may take before what it brought is all there is
_WAKE = 0.25  # seconds between checks for events that stopped


@dataclass(frozen=True)
class KvSource:
    """Where one instance publishes: its PUB endpoint, its replay ROUTER (None: no
    replay), and the topic (vLLM's default, empty, matches every topic)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class KvListeners:
    """One listener task per instance with a `KvSource`, started and stopped as the fleet
    changes (`apply`)."""

    def __init__(
        self,
        index_of: Callable[[str], KvIndex | None],
        clock: Callable[[], float],
        grace: float,
    ) -> None:
        self._index_of = index_of
        self._clock = clock
        self._grace = grace
        self._context: zmq.asyncio.Context | None = None  # made for the first source
        self._tasks: dict[str, tuple[KvSource, asyncio.Task[None]]] = {}

    def apply(self, sources: Mapping[str, KvSource]) -> None:
        """Listen to exactly these instances: new ones start, gone or moved ones stop.

        It takes the instances' sources (fleet/inputs.py's `kv_sources`), not the `Config`:
        the instance list is discovery's as much as the files'; the grace is fixed at start."""
        for name in list(self._tasks):
            source, task = self._tasks[name]
            if sources.get(name) != source:
                task.cancel()
                del self._tasks[name]
        for name, source in sources.items():
            if name not in self._tasks:
                if self._context is None:
                    self._context = zmq.asyncio.Context()
                listener = _Listener(name, source, self._context, self._index_of, self._clock)
                task = asyncio.create_task(listener.run(self._grace), name=f"kv-events {name}")
                self._tasks[name] = (source, task)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.term()


class _Listener:
    def __init__(
        self,
        name: str,
        source: KvSource,
        context: zmq.asyncio.Context,
        index_of: Callable[[str], KvIndex | None],
        clock: Callable[[], float],
    ) -> None:
        self.name = name
        self.source = source
        self.context = context
        self.index_of = index_of
        self.clock = clock

    async def run(self, grace: float) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop here: a drop is a gap to replay
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        # Waiting is asyncio's (poll); reading is not: every batch that came meanwhile is
        # taken at once from the same socket, without a future each.
        now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        try:
            while True:
                if await sub.poll(_WAKE * 1000):
                    while True:
                        try:
                            frames = now.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        index = self.index_of(self.name)
                        if index is not None and len(frames) == 3 and len(frames[1]) == 8:
                            seq = int.from_bytes(frames[1], "big")
                            await self._arrived(index, seq, frames[2])
                index = self.index_of(self.name)
                if index is not None and index.check(self.clock(), grace):
                    log.warning(
                        "kv_events_stopped",
                        server=self.name,
                        grace_s=grace,
                        hint="the instance computed a prompt and published no event for it; "
                        "its prefix cache is estimated until events come again",
                    )
        finally:
            sub.close(linger=0)

    async def _arrived(self, index: KvIndex, seq: int, payload: bytes) -> None:
        action = index.arrival(seq)
        if action == "restart":
            log.info("kv_events_restarted", server=self.name, seq=seq)
            index.restarted()
            action = index.arrival(seq)
        if action == "replay":
            start = index.replay_from()
            index.gap(replaying=self.source.replay_endpoint is not None)
            for replayed, batch in await self._replay(start, seq):
                if (index.next_seq or 0) <= replayed <= seq:
                    self._take(index, replayed, batch)
            if (index.next_seq or 0) > seq:
                return  # the replay brought this one too
        self._take(index, seq, payload)

    def _take(self, index: KvIndex, seq: int, payload: bytes) -> None:
        """Apply batch `seq`, the next one or past a gap that cannot be filled any more."""
        if index.arrival(seq) == "replay":
            index.unreplayed(seq)
            log.warning("kv_events_lost", server=self.name, resumed_at=seq, state=index.state.value)
        try:
            events = decode_batch(payload)
        except BadPayload as exc:
            index.malformed(seq)
            log.warning("kv_events_malformed", server=self.name, seq=seq, error=str(exc))
            return
        index.apply_batch(seq, events, self.clock())

    async def _replay(self, start: int, until: int) -> list[tuple[int, bytes]]:
        """The batches from `start` that the replay socket still holds, up to `until`."""
        endpoint = self.source.replay_endpoint
        if endpoint is None:
            return []
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _REPLAY_TIMEOUT
            while (left := deadline - loop.time()) > 0 and await dealer.poll(left * 1000):
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    break
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END:
                    break
                out.append((seq, frames[2]))
                if seq >= until:
                    break
        finally:
            dealer.close(linger=0)
        return out
