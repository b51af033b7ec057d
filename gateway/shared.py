"""The one seam to the shared store: publish what this process holds, read what the others do.

Several gateway processes (workers of one gateway, replicas behind a load balancer) front
one fleet. Each sees its own requests exactly and the instances' `/metrics` late; without
the others' load they herd onto the same instance and each applies the per-instance limit
on its own. So every `publish_interval` (a quarter second by default, never on a
request's path) each process writes to Redis what it holds, under a key of its own with a
TTL, and reads every other process's key in the same round:

    per instance   requests in flight, uncached prompt tokens in prefill, learned speed
    per lane       requests waiting in its queue
    retry budget   requests and retries in its window

and appends to one Redis stream the prompts it placed where they were not cached yet
(instance and block hashes), which every other process reads into its prefix index: so
replicas agree where a prefix lives instead of each caching it somewhere else.

The sum of the others' becomes the scheduler's `SharedView`: their load counts toward each
instance's limit and score, their queues toward the gateway queue's bound, their retries
toward the budget, and their learned speeds blend with ours. A process that dies stops
writing; its key expires after `ttl` and its load leaves every view with it.

If Redis is away or slow, the process logs it once, sets `gateway_shared_state_up` to 0,
dispatches on its own view (own load plus the instances' metrics) and keeps trying, with
backoff, until Redis answers again. No request waits on Redis or fails because of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from . import log
from .dispatch import Lane, LocalShare, PeerLoad, PeerSpeed, RetryBudget, SharedView
from .dispatcher import Dispatcher

_log = log.get("gateway.shared")

BACKOFF_MAX = 5.0  # seconds between attempts while Redis is away
STREAM_MAXLEN = 20_000  # placements kept in the stream (approximately: Redis trims lazily)
CATCH_UP = 500  # placements a new process reads back from before it started


@dataclass(frozen=True)
class PeerEntry:
    """One other process's publication, decoded."""

    share: LocalShare
    requests: int
    retries: int


def encode(share: LocalShare, requests: int, retries: int) -> bytes:
    """This process's publication: compact JSON, a few dozen bytes per instance."""
    body = {
        "loads": {name: [p.inflight, p.pending_prefill_tokens] for name, p in share.loads.items()},
        "speeds": {
            name: [s.prefill, s.prefill_samples, s.tpot, s.tpot_samples]
            for name, s in share.speeds.items()
        },
        "queued": {lane.value: n for lane, n in share.queued.items()},
        "budget": [requests, retries],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes | str) -> PeerEntry:
    """Another process's publication; ValueError if it is malformed."""
    try:
        return _decode(json.loads(data))
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"malformed publication: {type(exc).__name__}: {exc}") from None


def _decode(body: dict[str, Any]) -> PeerEntry:
    loads = {name: PeerLoad(int(v[0]), int(v[1])) for name, v in body["loads"].items()}
    speeds = {
        name: PeerSpeed(
            None if v[0] is None else float(v[0]),
            int(v[1]),
            None if v[2] is None else float(v[2]),
            int(v[3]),
        )
        for name, v in body["speeds"].items()
    }
    queued = {Lane(lane): int(n) for lane, n in body["queued"].items()}
    requests, retries = (int(n) for n in body["budget"])
    return PeerEntry(LocalShare(loads, speeds, queued), requests, retries)


def combine(entries: list[PeerEntry]) -> SharedView:
    """The others' publications summed into one view (speeds kept apart, to blend)."""
    inflight: dict[str, int] = {}
    pending: dict[str, int] = {}
    speeds: dict[str, list[PeerSpeed]] = {}
    queued: dict[Lane, int] = {}
    for entry in entries:
        for name, load in entry.share.loads.items():
            inflight[name] = inflight.get(name, 0) + load.inflight
            pending[name] = pending.get(name, 0) + load.pending_prefill_tokens
        for name, speed in entry.share.speeds.items():
            speeds.setdefault(name, []).append(speed)
        for lane, n in entry.share.queued.items():
            queued[lane] = queued.get(lane, 0) + n
    loads = {name: PeerLoad(inflight[name], pending[name]) for name in inflight}
    return SharedView(loads=loads, speeds=speeds, queued=queued, peers=len(entries))


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or parts.path or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


class SharedState:
    def __init__(
        self,
        url: str,
        dispatcher: Dispatcher,
        budget: RetryBudget,
        *,
        interval: float = 0.25,
        ttl: float = 3.0,
        namespace: str = "gateway",
        process_id: str | None = None,
    ) -> None:
        self.url = url
        self.dispatcher = dispatcher
        self.budget = budget
        self.interval = interval
        self.ttl = ttl
        self.process_id = (
            process_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        )
        self._members = f"{namespace}:processes"
        self._prefix = f"{namespace}:process:"
        self._stream = f"{namespace}:placements"
        self._stream_at: str | None = None  # the last placement read
        # Every call is bounded: a slow Redis costs a round, never a request.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=max(0.5, interval * 2), socket_connect_timeout=1.0
        )
        self.up: bool | None = None  # None until the first round
        self.peers = 0
        self.rounds = 0

    async def run_forever(self) -> None:
        failures = 0
        task = asyncio.current_task()
        while True:
            ok = await self.run_round()
            # redis-py (8.1) can swallow a cancellation that lands inside a command: the
            # command returns as if nothing happened. Honour the request here, or shutdown
            # would wait for this task forever.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            failures = 0 if ok else failures + 1
            delay = self.interval if ok else min(BACKOFF_MAX, self.interval * 2**failures)
            await asyncio.sleep(delay)

    async def run_round(self) -> bool:
        """Publish ours, read theirs, hand the view to the scheduler; False if Redis failed."""
        try:
            async with asyncio.timeout(max(1.0, self.ttl / 2)):
                view, requests, retries = await self._exchange()
        except (RedisError, OSError, TimeoutError, ValueError) as exc:
            self._set_up(False, exc)
            view, requests, retries = SharedView(), 0, 0  # the local view alone
        else:
            self._set_up(True)
        self.rounds += 1
        self.peers = view.peers
        self.budget.peer_requests, self.budget.peer_retries = requests, retries
        self.dispatcher.apply_shared(view)
        return self.up is True

    async def _exchange(self) -> tuple[SharedView, int, int]:
        scheduler = self.dispatcher.scheduler
        share = scheduler.share()
        requests, retries = self.budget.own_totals(self.dispatcher.clock())
        placements = scheduler.take_placements()
        if self._stream_at is None:
            await self._catch_up()
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(
                self._prefix + self.process_id,
                encode(share, requests, retries),
                px=int(self.ttl * 1000),
            )
            pipe.sadd(self._members, self.process_id)
            pipe.smembers(self._members)
            if placements:
                entry = {"p": self.process_id, "d": json.dumps(placements)}
                pipe.xadd(self._stream, entry, maxlen=STREAM_MAXLEN, approximate=True)  # type: ignore[arg-type]
            pipe.xread({self._stream: self._stream_at or "0-0"}, count=1000)
            results = await pipe.execute()
        self._learn(results[-1])
        others = sorted(m.decode() for m in results[2] if m.decode() != self.process_id)
        if not others:
            return SharedView(), 0, 0
        values = await self._redis.mget([self._prefix + p for p in others])
        entries: list[PeerEntry] = []
        gone: list[str] = []
        for process, value in zip(others, values, strict=True):
            if value is None:  # its key expired: that process died or left
                gone.append(process)
                continue
            try:
                entries.append(decode(value))
            except ValueError:
                _log.warning("shared_state_entry_malformed", process=process)
        if gone:
            await self._redis.srem(self._members, *gone)
        return (
            combine(entries),
            sum(e.requests for e in entries),
            sum(e.retries for e in entries),
        )

    async def _catch_up(self) -> None:
        """On joining, read the newest placements the others made before we started."""
        recent: list[Any] = list(await self._redis.xrevrange(self._stream, count=CATCH_UP) or ())
        self._stream_at = "0-0"
        self._learn([[self._stream, recent[::-1]]])

    def _learn(self, streams: Any) -> None:
        """Placements other processes made: into our prefix indexes."""
        for _, entries in streams or ():
            for entry_id, fields in entries:
                self._stream_at = _text(entry_id)
                if _text(fields.get(b"p", b"")) == self.process_id:
                    continue
                try:
                    placements = json.loads(fields[b"d"])
                    learned = [(str(name), [int(b) for b in blocks]) for name, blocks in placements]
                except (KeyError, ValueError, TypeError):
                    _log.warning("shared_state_entry_malformed", stream=self._stream)
                    continue
                self.dispatcher.scheduler.learn_placements(learned)

    def _set_up(self, up: bool, error: BaseException | None = None) -> None:
        if up == self.up:
            return
        if up:
            _log.info("shared_state_up", redis=redacted(self.url), process=self.process_id)
        else:
            # Once per outage, not once per round.
            _log.warning(
                "shared_state_down",
                redis=redacted(self.url),
                error=type(error).__name__ if error else None,
                detail=str(error)[:200] if error else None,
            )
        self.up = up

    async def close(self) -> None:
        """Leave the view at once (rather than after the TTL), then drop the connection."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.delete(self._prefix + self.process_id)
                    pipe.srem(self._members, self.process_id)
                    await pipe.execute()
        await self._redis.aclose()

    def __repr__(self) -> str:
        state = {None: "starting", True: "up", False: "down"}[self.up]
        return f"<SharedState {redacted(self.url)} {state} peers={self.peers}>"


class SharedStateCollector(Collector):
    """`gateway_shared_state_up` and `gateway_shared_state_peers`, read at scrape time."""

    def __init__(self, shared: SharedState) -> None:
        self.shared = shared

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gateway_shared_state_up",
            "1 while the shared store (Redis) answers; 0 while this process dispatches on "
            "its own view.",
        )
        up.add_metric([], 1.0 if self.shared.up else 0.0)
        yield up
        peers = GaugeMetricFamily(
            "gateway_shared_state_peers",
            "Other gateway processes (workers, replicas) in the shared view.",
        )
        peers.add_metric([], self.shared.peers)
        yield peers


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
