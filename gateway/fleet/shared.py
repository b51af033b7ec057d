"""The one seam to the shared store: publish what this process holds, read what the others do.

Several gateway processes (workers of one gateway, replicas behind a load balancer) front
one fleet. Each sees its own requests exactly and the instances' `/metrics` late; without
the others' load they herd onto the same instance and each applies the per-instance limit
on its own. So every `publish_interval` (a quarter second by default, never on a
request's path) each process writes to Redis what it holds, under a key of its own with a
TTL, and reads every other process's key in the same round:

    per instance   requests in flight, uncached prompt tokens in prefill, long requests
                   in prefill (max_long_per_instance), learned speed
    per lane       requests waiting in its queue
    retry budget   requests and retries in its window

and appends to one Redis stream the prompts it placed where they were not cached yet
(instance and block hashes), which every other process reads into its prefix index: so
replicas agree where a prefix lives instead of each caching it somewhere else.

A view a round old is too old where requests come faster than rounds: a 6,000-token prompt
prefills in a third of a second, and replicas that all see an instance idle for a quarter
second all send there. So between rounds each process also pushes its load on a Redis
pub/sub channel when it changes (at once after a quiet spell; while it keeps changing, at
most once per `push_interval`, 20 ms, the changes in between sent as one), and every
process applies the others' pushes as they arrive. A push is one PUBLISH: the placements
it carries reach the stream with the next round, in one entry (a process that joins later
reads them there), and a process drops its own pushes, coming back on the channel, before
parsing them. Each
publication carries a sequence number, so a round's read never replaces a newer push with
the older key. The rounds stay the source of membership and expiry: a process is in the
view while its key lives.

The sum of the others' becomes the scheduler's `SharedView`: their load counts toward each
instance's limit and score, their queues toward the gateway queue's bound, their retries
toward the budget, and their learned speeds blend with ours. A process that dies stops
writing; its key expires after `ttl` and its load leaves every view with it.

If Redis is away or slow, the process logs it once, sets `gateway_shared_state_up` to 0,
dispatches on its own view (own load plus the instances' metrics) and keeps trying, at
most `BACKOFF_MAX` apart and on a fresh connection, until Redis answers again. No request
waits on Redis or fails because of it.

What is read from Redis is untrusted (shared_codec.py bounds it): an entry too large is
not even fetched whole (GETRANGE), a bad one is dropped and counted, and no failure of
any kind ends the rounds or the listener. Every failure is counted in
`gateway_shared_state_errors_total{reason}` and logged at most once a minute per reason.
A peer whose publication has not moved for `ttl` seconds leaves the view, whatever its key
says (a key written without a TTL would otherwise stay forever). `gateway_shared_state_up`
is 1 only while the view is actually shared: the last round went through and, with pushes
on, the listener is subscribed.

**Strict caps** (`[shared] strict_caps`). The view above counts the others' load as last
heard, so while pushes are in flight a few more requests than an instance's cap can land
on it. With strict caps every place is also a lease in Redis, taken atomically by a Lua
script: a sorted set per instance of `process:ticket` members scored by their expiry
(Redis's own clock), trimmed of expired leases and checked against the cap in one step.
A request whose lease is refused is placed again elsewhere (dispatcher.py). Leases are
renewed every round and given back when the attempt ends; a dead process's expire after
`LEASE_S`. The price is one Redis round trip per request; if Redis does not answer in
`CLAIM_TIMEOUT_S`, the local view decides, as without strict caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError, ResponseError

from gateway.dispatch import LocalShare, RetryBudget, SharedView
from gateway.dispatch.fleet import MAX_PLACEMENTS
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.drains import DrainOrder, parse_since
from gateway.fleet.shared_codec import (
    MAX_ENTRY_BYTES,
    PeerEntry,
    Refused,
    combine,
    decode,
    encode,
    newest,
    parse_placements,
    parse_push,
    push_key,
    push_message,
    redacted,
)
from gateway.observe import log

_log = log.get("gateway.shared")

BACKOFF_MAX = 1.0  # seconds between attempts while Redis is away: back within a second
MAX_PEERS = 256  # other processes read per round; more is a misconfiguration, not a fleet
LOG_EVERY_S = 60.0  # the same failure is logged at most this often (with a count)
LEASE_S = 10.0  # a strict-caps lease lives this long unless renewed (a round renews it)
CLAIM_TIMEOUT_S = 0.5  # a claim Redis does not answer in this long is decided locally

# KEYS[1]: the instance's leases; ARGV: member, cap, lease ms. {1 if the place is ours,
# forged leases dropped}: a lease lives at most its time from now, so one scored later was
# not written by a gateway (it would hold a place for good).
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local latest = string.format('(%.0f', now + tonumber(ARGV[3]))
local forged = redis.call('ZREMRANGEBYSCORE', KEYS[1], latest, '+inf')
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  return {1, forged}
end
return {0, forged}
"""
# KEYS: lease sets; ARGV[1]: lease ms, then one member per key: renew if held (the strict
# caps' places, and the named keys' places, shared_limits.py).
RENEW_LEASES = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', until_ms, ARGV[i + 1])
end
return #KEYS
"""
STREAM_MAXLEN = 20_000  # placements kept in the stream (approximately: Redis trims lazily)
CATCH_UP = 500  # placements a new process reads back from before it started


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
        push_interval: float = 0.02,
        strict_caps: bool = False,
    ) -> None:
        self.url = url
        self.dispatcher = dispatcher
        self.budget = budget
        self.interval = interval
        self.ttl = ttl
        self.push_interval = push_interval  # 0: rounds only
        self.process_id = (
            process_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        )
        self._members = f"{namespace}:processes"
        self._prefix = f"{namespace}:process:"
        self._stream = f"{namespace}:placements"
        self._channel = f"{namespace}:pushes"
        self._leases = f"{namespace}:leases:"  # + instance: a sorted set of held places
        self._drained = f"{namespace}:drained"  # the operator's drains (drains.py)
        # Called each round with the drains the store holds for our instances.
        self.on_drains: Callable[[dict[str, float]], None] | None = None
        self._held: dict[int, str] = {}  # ticket -> instance, the leases we hold
        self._unheld: list[tuple[str, int]] = []  # leases to give back
        self._give_back = asyncio.Event()
        self._stream_at: str | None = None  # the last placement read
        # Placements the pushes told the others, for the next round to append to the
        # stream in one entry: one stream write a round rather than one a push, and a
        # round reads back one entry of its own rather than a dozen. Only a process that
        # joins later reads the stream for them, and a round later is soon enough.
        self._unstreamed: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=MAX_PLACEMENTS)
        self._own_tag = self.process_id.encode() + b" "  # how our own pushes start
        self._seq = 0  # publications made, pushes and keys alike
        self._pushed: tuple[object, ...] | None = None  # what the last publication said
        self._peers: dict[str, PeerEntry] = {}  # the others' newest publications
        self._changed = asyncio.Event()  # set by the dispatcher when our load may have moved
        # Every call is bounded: a slow Redis costs a round, never a request.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=max(0.5, interval * 2), socket_connect_timeout=1.0
        )
        self.up: bool | None = None  # None until the first round
        self.round_ok: bool | None = None  # the last round went through
        self.errors: dict[str, int] = {}  # failures by reason, for the counter
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last logged, since)
        self._moved: dict[str, tuple[int, float]] = {}  # peer -> (seq, when it last moved)
        self._rng = random.Random()  # which unknown processes a crowded round reads
        self.peers = 0
        self.rounds = 0
        self.pushes_sent = 0
        self.pushes_heard = 0
        self.listening = False  # subscribed to the others' pushes
        self.strict_caps = strict_caps
        self._claim_script = self._redis.register_script(_CLAIM)
        self._renew_script = self._redis.register_script(RENEW_LEASES)
        self._deaf = False  # the listener lost its subscription and has not got it back

    async def run_forever(self) -> None:
        """The rounds, and between them the pushes both ways, until cancelled."""
        helpers = []
        if self.push_interval > 0:
            self.dispatcher.on_change = self._changed.set
            helpers = [
                asyncio.create_task(self._push_forever(), name="shared-state-push"),
                asyncio.create_task(self._listen_forever(), name="shared-state-listen"),
            ]
        if self.strict_caps:
            self.dispatcher.claim, self.dispatcher.unclaim = self.claim, self.unclaim
            helpers.append(asyncio.create_task(self._give_back_forever(), name="shared-leases"))
        try:
            await self._rounds_forever()
        finally:
            if self.strict_caps:
                self.dispatcher.claim = self.dispatcher.unclaim = None
            if helpers:
                self.dispatcher.on_change = None
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    async def _rounds_forever(self) -> None:
        failures = 0
        while True:
            ok = await self.run_round()
            honour_cancel()
            failures = 0 if ok else failures + 1
            delay = self.interval if ok else min(BACKOFF_MAX, self.interval * 2**failures)
            await asyncio.sleep(delay)

    async def run_round(self) -> bool:
        """Publish ours, read theirs, hand the view to the scheduler; False if it failed."""
        try:
            async with asyncio.timeout(max(1.0, self.ttl / 2)):
                self._peers = self._alive(await self._exchange())
                if self.strict_caps:
                    await self._renew()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = "redis" if isinstance(exc, RedisError | OSError | TimeoutError) else "round"
            self.failed(reason, exc)
            self.round_ok = False
            self._peers = {}  # the local view alone
            # The next round on a fresh connection: one pooled from before a Redis restart
            # would fail that round too.
            with contextlib.suppress(Exception):
                await self._redis.connection_pool.disconnect()
        else:
            self.round_ok = True
        self._refresh_up()
        self.rounds += 1
        self._apply()
        return self.round_ok is True

    @property
    def redis(self) -> aioredis.Redis:
        """The connection, for the features that share it (shared_limits.py): bounded
        timeouts, and a fresh one after each failed round."""
        return self._redis

    async def claim(self, instance: str, ticket: int, cap: int) -> bool | None:
        """Take one of `cap` places on `instance` in Redis: True if ours, False if all are
        taken, None if Redis did not answer in time (the local view decides)."""
        if self.up is not True:
            return None  # Redis is away: no request waits for it (the local view decides)
        member = f"{self.process_id}:{ticket}"
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                got = await self._claim_script(
                    keys=[self._leases + instance], args=[member, cap, int(LEASE_S * 1000)]
                )
        except asyncio.CancelledError:
            self._give_back_lease(instance, ticket)  # it may have gone through
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            self._give_back_lease(instance, ticket)  # a timed-out script may have taken it
            self.failed("redis", exc)
            return None
        ours, forged = _claim_answer(got)
        if forged:
            self.failed("forged_lease", f"{forged} of {instance}'s leases past a lease's time")
        if ours:
            self._held[ticket] = instance
        return ours

    def unclaim(self, ticket: int) -> None:
        """Give back the lease `ticket` holds, if it holds one."""
        instance = self._held.pop(ticket, None)
        if instance is not None:
            self._give_back_lease(instance, ticket)

    def _give_back_lease(self, instance: str, ticket: int) -> None:
        """Soon, in one pipeline with the others given back meanwhile."""
        self._held.pop(ticket, None)
        self._unheld.append((instance, ticket))
        self._give_back.set()

    async def _give_back_forever(self) -> None:
        while True:
            await self._give_back.wait()
            self._give_back.clear()
            batch, self._unheld = self._unheld, []
            try:
                async with asyncio.timeout(max(1.0, self.ttl / 2)):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for instance, ticket in batch:
                            pipe.zrem(self._leases + instance, f"{self.process_id}:{ticket}")
                        await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # they expire after LEASE_S in any case
                self.failed("redis", exc)
            honour_cancel()

    async def _renew(self) -> None:
        """Our leases live another LEASE_S: a stream may hold its place for minutes."""
        held = list(self._held.items())
        if not held:
            return
        await self._renew_script(
            keys=[self._leases + instance for _, instance in held],
            args=[int(LEASE_S * 1000), *(f"{self.process_id}:{t}" for t, _ in held)],
        )

    def _alive(self, read: dict[str, PeerEntry]) -> dict[str, PeerEntry]:
        """The peers whose publication moved within `ttl` (by our clock): a process that
        stopped publishing leaves, even if its key never expires."""
        now = self.dispatcher.clock()
        alive = {}
        for process, entry in read.items():
            seq, since = self._moved.get(process, (-1, now))
            if entry.seq != seq:
                since = now
            self._moved[process] = (entry.seq, since)
            if now - since <= self.ttl:
                alive[process] = entry
        for gone in self._moved.keys() - read.keys():
            del self._moved[gone]
        return alive

    def _freshest(self, listed: list[str]) -> list[str]:
        """`MAX_PEERS` of the processes listed: those whose publications moved most
        recently first, then the others in a random order. Names that sort first (any
        writer to Redis can list some) never crowd out the live peers, and a new peer
        gets its turn among the unknown ones."""
        known = sorted(
            (p for p in listed if p in self._moved), key=lambda p: self._moved[p][1], reverse=True
        )
        unknown = [p for p in listed if p not in self._moved]
        self._rng.shuffle(unknown)
        return (known + unknown)[:MAX_PEERS]

    def failed(self, reason: str, error: BaseException | str) -> None:
        """Count a failure and log it, at most once a minute per reason."""
        self.errors[reason] = self.errors.get(reason, 0) + 1
        now = self.dispatcher.clock()
        last, since = self._logged.get(reason, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self._logged[reason] = (last, since + 1)
            return
        self._logged[reason] = (now, 0)
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        _log.warning(
            "shared_state_error",
            reason=reason,
            detail=str(detail)[:200],
            suppressed=since,
            redis=redacted(self.url),
        )

    def _refresh_up(self) -> None:
        """Up only while the view is shared: rounds go through and the listener, once
        subscribed, has not lost its subscription."""
        self._set_up(self.round_ok is True and not self._deaf)

    def _apply(self, stagger: float = 0.0) -> None:
        entries = list(self._peers.values())
        self.peers = len(entries)
        self.budget.peer_requests = sum(e.requests for e in entries)
        self.budget.peer_retries = sum(e.retries for e in entries)
        view = combine(entries) if entries else SharedView()
        self.dispatcher.apply_shared(view, stagger)

    def _publication(self, share: LocalShare | None = None) -> bytes:
        """Ours now, numbered; remembered as the last thing the others were told."""
        if share is None:
            share = self.dispatcher.local_share()
        requests, retries = self.budget.own_totals(self.dispatcher.clock())
        self._seq += 1
        self._pushed = push_key(share)
        return encode(share, requests, retries, self._seq)

    async def _exchange(self) -> dict[str, PeerEntry]:
        placements = [*self._unstreamed, *self.dispatcher.take_placements()]
        self._unstreamed.clear()  # sent with this round, or lost with it if Redis fails
        if self._stream_at is None:
            await self._catch_up()
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._prefix + self.process_id, self._publication(), px=int(self.ttl * 1000))
            pipe.sadd(self._members, self.process_id)
            pipe.smembers(self._members)
            if placements:
                self._add_placements(pipe, placements)
            pipe.xread({self._stream: self._stream_at or "0-0"}, count=1000)
            results = await pipe.execute()
        self._learn(results[-1])
        await self._read_drains()
        others = [_text(m) for m in results[2] if _text(m) != self.process_id]
        if len(others) > MAX_PEERS:
            self.failed("too_many_peers", f"{len(others)} processes listed, {MAX_PEERS} read")
            others = self._freshest(others)
        if not others:
            return {}
        # At most one byte past the limit of each: a huge entry is refused, not fetched.
        async with self._redis.pipeline(transaction=False) as pipe:
            for process in others:
                pipe.getrange(self._prefix + process, 0, MAX_ENTRY_BYTES)
            values = await pipe.execute()
        known = self.dispatcher.instance_names()
        read: dict[str, PeerEntry] = {}
        gone: list[str] = []
        for process, value in zip(others, values, strict=True):
            if not value:  # its key expired: that process died or left
                gone.append(process)
                continue
            try:
                read[process] = decode(value, known)
            except ValueError as exc:
                self.failed(exc.reason if isinstance(exc, Refused) else "malformed", exc)
        if gone:
            await self._redis.srem(self._members, *gone)
        # A push heard while this round was on its way may be newer than the key.
        return {p: newest(self._peers.get(p), entry) for p, entry in read.items()}

    async def _read_drains(self) -> None:
        """The drains the store holds for our instances (only theirs: a poisoned hash costs
        no more than the fleet), handed to `on_drains`. An entry of the wrong type is
        counted and skipped, never the round's end."""
        names = sorted(self.dispatcher.instance_names())
        if not names or self.on_drains is None:
            return
        try:
            values = await self._redis.hmget(self._drained, names)
        except ResponseError as exc:  # not a hash
            self.failed("malformed", exc)
            return
        drained: dict[str, float] = {}
        for name, raw in zip(names, values, strict=True):
            since = parse_since(raw)
            if since is not None:
                drained[name] = since
            elif raw is not None:
                self.failed("malformed", f"drain entry of {name!r}: {raw[:40]!r}")
        self.on_drains(drained)

    async def store_drain(self, order: DrainOrder) -> bool:
        """Write a drain or a resume to the store; False if Redis did not take it."""
        try:
            async with asyncio.timeout(max(1.0, self.ttl / 2)):
                if order.since is None:
                    await self._redis.hdel(self._drained, order.name)
                else:
                    await self._redis.hset(self._drained, order.name, repr(order.since))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failed("redis", exc)
            return False
        return True

    def _add_placements(self, pipe: Any, placements: list[tuple[str, tuple[int, ...]]]) -> None:
        entry = {"p": self.process_id, "d": json.dumps(placements)}
        pipe.xadd(self._stream, entry, maxlen=STREAM_MAXLEN, approximate=True)

    async def _push_forever(self) -> None:
        """When our load or queues change, push them: at once after a quiet spell, and at
        most once per `push_interval` while they keep changing (the changes in between
        go as one push)."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self.up is not True:
                continue
            share = self.dispatcher.local_share()
            if push_key(share) == self._pushed:
                continue
            placements = self.dispatcher.take_placements()
            settled = self.dispatcher.take_settled()
            message = push_message(self.process_id, self._publication(share), placements, settled)
            # The stream gets them with the next round (a process that starts later reads
            # them there), so a push is one command: PUBLISH, no pipeline.
            self._unstreamed.extend(placements)
            # A failed push is not retried: the next change, or the next round, tells.
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(max(0.5, self.interval * 2)):
                    await self._redis.publish(self._channel, message)
                    self.pushes_sent += 1
            honour_cancel()
            await asyncio.sleep(self.push_interval)

    async def _listen_forever(self) -> None:
        """The others' pushes, applied as they come; resubscribes after Redis comes back."""
        while True:
            try:
                async with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self._channel)
                    self.listening, self._deaf = True, False
                    self._refresh_up()
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        honour_cancel()
                        if message is not None and message.get("type") == "message":
                            self._heard(message["data"])
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError):
                pass  # the rounds count and log the outage
            except Exception as exc:
                self.failed("listener", exc)
            self.listening, self._deaf = False, True
            self._refresh_up()
            honour_cancel()
            await asyncio.sleep(min(BACKOFF_MAX, max(self.interval, 0.1)))

    def _heard(self, data: bytes | str) -> None:
        """One push of another process: its newest load replaces what we had of it."""
        if self.up is not True:
            return  # while Redis is away the view is ours alone; the next round rejoins
        raw = data.encode() if isinstance(data, str) else data
        if raw.startswith(self._own_tag):
            return  # our own push, back from the channel: not worth parsing
        try:
            process, payload, placements, settled = parse_push(raw)
            entry = decode(payload, self.dispatcher.instance_names())
        except ValueError as exc:
            self.failed(exc.reason if isinstance(exc, Refused) else "malformed", exc)
            return
        if placements:  # the stream brings them again at the next round: harmless
            self.dispatcher.learn_placements(placements)
        if settled:
            self.dispatcher.learn_settled(settled)
        old = self._peers.get(process)
        if old is not None and entry.seq <= old.seq:
            return
        self.pushes_heard += 1
        self._peers[process] = entry
        # Every process hears this push at once: staggered, those with requests waiting
        # do not all put one into the room it freed (dispatcher.apply_shared).
        self._apply(stagger=self.push_interval / 2)

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
                    learned = parse_placements(fields[b"d"])
                except (KeyError, ValueError) as exc:
                    self.failed(exc.reason if isinstance(exc, Refused) else "malformed", exc)
                    continue
                self.dispatcher.learn_placements(learned)

    def _set_up(self, up: bool) -> None:
        if up == self.up:
            return
        if up:
            _log.info("shared_state_up", redis=redacted(self.url), process=self.process_id)
        else:  # once per outage; its cause is the shared_state_error line
            _log.warning("shared_state_down", redis=redacted(self.url), process=self.process_id)
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
        errors = CounterMetricFamily(
            "gateway_shared_state_errors",
            "Failures of the shared view by reason: redis (away or slow), malformed, "
            "too_large, out_of_bounds (an entry refused), too_many_peers, round, listener.",
            labels=["reason"],
        )
        for reason, count in sorted(self.shared.errors.items()):
            errors.add_metric([reason], count)
        yield errors


def _claim_answer(answer: Any) -> tuple[bool, int]:
    """The claim script's answer: whether the place is ours, and the forged leases it
    dropped (an answer of another shape takes no place)."""
    if isinstance(answer, list | tuple) and len(answer) == 2:
        ours, forged = answer
        if isinstance(ours, int) and isinstance(forged, int):
            return ours == 1, max(0, forged)
    return False, 0


def honour_cancel() -> None:
    """redis-py (8.1) can swallow a cancellation that lands inside a command: the command
    returns as if nothing happened. Honour the request, or shutdown would wait forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
