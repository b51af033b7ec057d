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
(instance and block hashes), which every other process reads into its prefix index
(shared_placements.py).

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

This module is the entry point (`SharedState`, which server/app.py starts) and the view
exchange itself: the rounds, the pushes both ways, the peers. The rest has a module each:
`shared_link` (the connection, this process's name, failures counted and logged, up or
down), `shared_placements` (the placements stream), `shared_leases` (strict caps' leases,
`[shared] strict_caps`), `shared_codec` (what an entry says, bounded), `shared_limits` (the
named keys' counters, on the same link). The operator's drains (drains.py) are read here,
each round, from the hash they are stored in.

May import: redis, prometheus_client, `gateway.dispatch`, `gateway.observe`, and the
fleet's `dispatcher`, `drains` and `shared_*` modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError, ResponseError

from gateway.dispatch import LocalShare, RetryBudget, SharedView
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
    parse_push,
    push_key,
    push_message,
    redacted,
)
from gateway.fleet.shared_leases import Leases
from gateway.fleet.shared_link import SharedLink, honour_cancel, text
from gateway.fleet.shared_placements import PlacementStream

BACKOFF_MAX = 1.0  # seconds between attempts while Redis is away: back within a second
MAX_PEERS = 256  # other processes read per round; more is a misconfiguration, not a fleet


class SharedState:
    """This process in the shared view: its rounds, its pushes and the others', with the
    placements stream and the strict caps' leases on the same link (the one object that
    server/app.py starts and stops)."""

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
        self.link = SharedLink(url, dispatcher.clock, interval=interval, process_id=process_id)
        self.process_id = self.link.process_id
        self._redis = self.link.redis  # the link's, for good: a failed round reconnects it
        self._members = f"{namespace}:processes"
        self._prefix = f"{namespace}:process:"
        self._channel = f"{namespace}:pushes"
        self._drained = f"{namespace}:drained"  # the operator's drains (drains.py)
        # Called each round with the drains the store holds for our instances.
        self.on_drains: Callable[[dict[str, float]], None] | None = None
        self.placements = PlacementStream(self.link, dispatcher, namespace)
        self.leases = Leases(self.link, namespace, ttl)
        self._own_tag = self.process_id.encode() + b" "  # how our own pushes start
        self._seq = 0  # publications made, pushes and keys alike
        self._pushed: tuple[object, ...] | None = None  # what the last publication said
        self._peers: dict[str, PeerEntry] = {}  # the others' newest publications
        self._changed = asyncio.Event()  # set by the dispatcher when our load may have moved
        self.round_ok: bool | None = None  # the last round went through
        self._moved: dict[str, tuple[int, float]] = {}  # peer -> (seq, when it last moved)
        self._rng = random.Random()  # which unknown processes a crowded round reads
        self.peers = 0
        self.rounds = 0
        self.pushes_sent = 0
        self.pushes_heard = 0
        self.listening = False  # subscribed to the others' pushes
        self.strict_caps = strict_caps
        self._deaf = False  # the listener lost its subscription and has not got it back

    @property
    def up(self) -> bool | None:
        """Whether the view is shared now (None until the first round): the link's, which
        the leases and the keys' limits read too."""
        return self.link.up

    @up.setter
    def up(self, up: bool | None) -> None:
        self.link.up = up

    @property
    def errors(self) -> dict[str, int]:
        """Failures by reason, of the view and of everything on its link."""
        return self.link.errors

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
            self.dispatcher.claim, self.dispatcher.unclaim = self.leases.claim, self.leases.unclaim
            helpers.append(
                asyncio.create_task(self.leases.give_back_forever(), name="shared-leases")
            )
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
            self.link.failed(reason, exc)
            self.round_ok = False
            self._peers = {}  # the local view alone
            await self.link.reconnect()  # the next round on a fresh connection
        else:
            self.round_ok = True
        self._refresh_up()
        self.rounds += 1
        self._apply()
        return self.round_ok is True

    async def claim(self, instance: str, ticket: int, cap: int) -> bool | None:
        """A strict-caps place on `instance` (shared_leases.py)."""
        return await self.leases.claim(instance, ticket, cap)

    async def _renew(self) -> None:
        """The round's renewal of our strict-caps leases."""
        await self.leases.renew()

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

    def _refresh_up(self) -> None:
        """Up only while the view is shared: rounds go through and the listener, once
        subscribed, has not lost its subscription."""
        self.link.set_up(self.round_ok is True and not self._deaf)

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
        placements = self.placements.to_send()
        await self.placements.join()
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._prefix + self.process_id, self._publication(), px=int(self.ttl * 1000))
            pipe.sadd(self._members, self.process_id)
            pipe.smembers(self._members)
            if placements:
                self.placements.append(pipe, placements)
            self.placements.read(pipe)
            results = await pipe.execute()
        self.placements.learn(results[-1])
        await self._read_drains()
        others = [text(m) for m in results[2] if text(m) != self.process_id]
        if len(others) > MAX_PEERS:
            self.link.failed("too_many_peers", f"{len(others)} processes listed, {MAX_PEERS} read")
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
                self.link.failed(exc.reason if isinstance(exc, Refused) else "malformed", exc)
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
            self.link.failed("malformed", exc)
            return
        drained: dict[str, float] = {}
        for name, raw in zip(names, values, strict=True):
            since = parse_since(raw)
            if since is not None:
                drained[name] = since
            elif raw is not None:
                self.link.failed("malformed", f"drain entry of {name!r}: {raw[:40]!r}")
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
            self.link.failed("redis", exc)
            return False
        return True

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
            self.placements.pushed(placements)
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
                self.link.failed("listener", exc)
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
            self.link.failed(exc.reason if isinstance(exc, Refused) else "malformed", exc)
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
