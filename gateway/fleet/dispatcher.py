"""The async side of the scheduler: waits for a place, wakes queued requests.

The pure `Scheduler` decides; this class owns the clock, the random generator and the
futures of requests waiting in the gateway queue, and turns decisions into results or
exceptions. Everything here runs on the event loop thread, so the scheduler's counts
change synchronously between awaits and never race.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

from gateway import errors
from gateway.dispatch import (
    Assigned,
    Decision,
    HealthPolicy,
    Hop,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    LocalShare,
    Outcome,
    Priority,
    Queued,
    Rejected,
    Scheduler,
    SharedView,
    Snapshot,
    Ticket,
)
from gateway.dispatch.kv_index import KvIndex
from gateway.observe import log
from gateway.observe.metrics import Metrics

_log = log.get("gateway.dispatcher")

_ids = itertools.count(1)  # ticket ids only need to be unique and increasing


class Lease:
    """An instance's place, held by one attempt: what the attempt may tell the scheduler.

    It owns the dispatcher and the ticket id, so the relay needs neither. `release` hands
    the place back once: a second call (a finally after an early release) does nothing.
    """

    __slots__ = (
        "_dispatcher",
        "_on_evict",
        "evicted",
        "first_token_at",
        "instance",
        "released",
        "ticket_id",
    )

    def __init__(self, dispatcher: Dispatcher, ticket_id: int, instance: str) -> None:
        self._dispatcher = dispatcher
        self.ticket_id = ticket_id
        self.instance = instance
        self.first_token_at: float | None = None  # when `prefill_done` was told, if it was
        self.released = False
        self.evicted = False  # taken back: the instance could not hold it (Scheduler.overbooked)
        self._on_evict: Callable[[], None] | None = None

    def evictable(self, abort: Callable[[], None] | None) -> None:
        """Until the answer commits, `abort` ends the attempt if the place is taken back;
        None: it committed, and nothing takes it back any more."""
        self._on_evict = abort

    def evict(self) -> bool:
        """Take the place back: the attempt is aborted and ends as taken back. False if it
        cannot be now (its answer's head has not come, or it committed)."""
        abort, self._on_evict = self._on_evict, None
        if abort is None or self.released:
            return False
        self.evicted = True
        abort()
        return True

    def prefill_done(self, at: float, ttft: float | None) -> None:
        """The first token reached the client at `at`; `ttft` teaches least_time (or None)."""
        if self.first_token_at is None and not self.released:
            self.first_token_at = at
            self._dispatcher.prefill_done(self.ticket_id, ttft)

    def observe_tpot(self, seconds: float) -> None:
        self._dispatcher.observe_tpot(self.instance, seconds)

    def release(self, outcome: Outcome, error: str | None = None) -> None:
        """Hand the place back with what the attempt says about the instance (once)."""
        if self.released:
            return
        self.released = True
        self._on_evict = None
        self._dispatcher.release(self.ticket_id, outcome, error)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.instance} ticket={self.ticket_id} {state}>"


class Dispatcher:
    def __init__(
        self,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.rng = rng or random.Random()
        # time.monotonic, not loop.time(): uvloop's loop clock has millisecond steps,
        # too coarse for time-per-token.
        self.clock = clock or time.monotonic
        self._waiters: dict[int, asyncio.Future[str]] = {}
        # Called after anything that may change our load (a request placed, queued, past
        # its prefill, released): the shared view's pusher listens (shared.py).
        self.on_change: Callable[[], None] | None = None
        # Called with an instance that holds more of ours than it ever showed running: the
        # prober looks at its metrics soon (Scheduler.unconfirmed).
        self.on_unconfirmed: Callable[[str], None] | None = None
        self._leases: dict[int, Lease] = {}  # the places attempts hold, by ticket
        # With [shared] strict_caps: take a place's lease in the shared store (True), be
        # refused it (False: the instance is full fleet-wide), or not hear (None: Redis is
        # away and the local view decides); and give it back.
        self.claim: Callable[[str, int, int], Awaitable[bool | None]] | None = None
        self.unclaim: Callable[[int], None] | None = None
        self._place_timer: asyncio.TimerHandle | None = None  # staggered placing (apply_shared)
        # The operator's drains (fleet/drains.py): name -> since, wall clock.
        self._drained: dict[str, float] = {}

    def snapshot(self) -> Snapshot:
        """The scheduler's state now, as a frozen copy (dispatch/snapshot.py)."""
        return self.scheduler.snapshot(self.clock())

    def new_ticket(
        self,
        lane: Lane,
        deadline: float,
        exclude: frozenset[str] = frozenset(),
        tokens: int = 0,
        max_tokens: int = 0,
        *,
        model: str | None = None,
        prefix: tuple[int, ...] = (),
        kv_chain: tuple[int, ...] = (),
        kv_block_size: int = 0,
        priority: Priority = Priority.INTERACTIVE,
        key: str = "default",
    ) -> Ticket:
        return Ticket(
            next(_ids),
            lane,
            deadline,
            exclude,
            tokens,
            max_tokens,
            model,
            prefix,
            kv_chain,
            kv_block_size,
            priority=priority,
            key=key,
        )

    def answered(self, key: str, output_tokens: int) -> None:
        """An answer of `key` ended with `output_tokens` relayed: its fair-share count."""
        self.scheduler.charge_output(key, output_tokens)

    def retry_ticket(self, ticket: Ticket, exclude: frozenset[str]) -> Ticket:
        """The same request again, under a new id, avoiding the instances in `exclude`."""
        return dataclasses.replace(ticket, id=next(_ids), exclude=exclude)

    async def acquire(self, ticket: Ticket) -> str:
        """Return the instance that takes `ticket`, waiting in the queue if need be.

        Raises the gateway error a client should see when it cannot be placed. If the
        caller is cancelled (its client left), the ticket leaves the queue at once.
        """
        decision = self.scheduler.submit(ticket, self.clock(), self.rng)
        self._changed()
        if isinstance(decision, Assigned):
            self._waited(ticket, 0.0)  # placed at once: its wait counts too, as none
            return decision.instance
        if isinstance(decision, Rejected):
            raise self._rejection(decision)
        return await self._wait(decision)

    async def lease(self, ticket: Ticket) -> Lease:
        """`acquire`, with the place wrapped in the `Lease` the attempt holds.

        With strict caps the place is also claimed in the shared store; an instance the
        store says is full is counted full and the request placed again (a new ticket).
        """
        instance = await self.acquire(ticket)
        while self.claim is not None:
            try:
                claimed = await self.claim(instance, ticket.id, self.scheduler.room(instance))
            except BaseException:  # the client left while we asked: the place goes back
                self.release(ticket.id, Outcome.NEUTRAL)
                raise
            removed = not self.scheduler.has(instance)  # by a reload, while we asked
            if claimed is not False and not removed:
                break
            if not removed:
                # Full first, then the place back: else the queue's next request would be
                # put into it, only to be refused by the store in turn.
                self.scheduler.note_full(instance)
            self.release(ticket.id, Outcome.NEUTRAL)  # and its lease, if it took one
            ticket = self.retry_ticket(ticket, ticket.exclude)
            instance = await self.acquire(ticket)
        lease = Lease(self, ticket.id, instance)
        self._leases[ticket.id] = lease
        if self.on_unconfirmed is not None and self.scheduler.unconfirmed(lease.instance):
            self.on_unconfirmed(lease.instance)
        return lease

    async def _wait(self, queued: Queued) -> str:
        """Wait until the scheduler places or rejects the ticket, or the caller is cancelled.

        Every outcome comes through the future, set by `_settle` from a scheduler decision:
        a place freed (`release`, `prefill_done`, `probe`) or the wait ran out (`_expire`,
        on a timer). So there is one way in and one way out: the timer never races the
        assignment, and whatever ends the wait, a place given and not used is handed back.
        """
        ticket = queued.ticket
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        self._waiters[ticket.id] = future
        started = self.clock()
        timer = loop.call_later(max(0.0, queued.wait_until - started), self._expire, ticket.id)
        try:
            instance = await future
        except BaseException:
            # Cancelled (the client left, or shutdown), or rejected. If it was given a
            # place in the same loop pass, nobody will use it: hand it back.
            if (
                not self.scheduler.cancel(ticket.id)
                and future.done()
                and not future.cancelled()
                and future.exception() is None
            ):
                self.release(ticket.id, Outcome.NEUTRAL)
            raise
        finally:
            timer.cancel()
            self._waiters.pop(ticket.id, None)
        self._waited(ticket, self.clock() - started)
        return instance

    def _waited(self, ticket: Ticket, seconds: float) -> None:
        """A place was found after `seconds` in the gateway queue: every placement is
        observed, so the wait's percentiles and a key's mean are of all placed requests."""
        lane = self.metrics.lane_names[ticket.lane]
        self.metrics.queue_wait.labels(lane, ticket.priority).observe(seconds)
        self.metrics.key_queue_wait.labels(ticket.key).observe(seconds)

    def _expire(self, ticket_id: int) -> None:
        self._settle(self.scheduler.expire(ticket_id, self.clock(), self.rng))
        self._changed()
        wait_until = self.scheduler.wait_until(ticket_id)
        if wait_until is not None:  # the loop's clock ran ahead of ours: look again soon
            delay = max(0.001, wait_until - self.clock())
            asyncio.get_running_loop().call_later(delay, self._expire, ticket_id)

    def release(self, ticket_id: int, outcome: Outcome, error: str | None = None) -> None:
        self._leases.pop(ticket_id, None)
        if self.unclaim is not None:  # its lease in the shared store, if it holds one
            self.unclaim(ticket_id)
        self._settle(self.scheduler.release(ticket_id, outcome, self.clock(), self.rng, error))
        self._changed()

    def prefill_done(self, ticket_id: int, ttft: float | None = None) -> None:
        self._settle(self.scheduler.prefill_done(ticket_id, self.clock(), self.rng, ttft))
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def observe_error(self, name: str, error: str) -> None:
        """A failure that is no verdict (a scrape's), kept for the operator."""
        self.scheduler.observe_error(name, error, self.clock())

    def observe_tpot(self, name: str, seconds: float) -> None:
        self.scheduler.observe_tpot(name, seconds)

    def probe(self, name: str, ok: bool, error: str | None = None) -> bool:
        """Record a health probe (and why it failed); return whether the verdict changed."""
        if not self.scheduler.has(name):
            return False  # removed by a reload while its probe was out
        before = self.scheduler.state(name).up
        self._settle(self.scheduler.probe(name, ok, self.clock(), self.rng, error))
        return self.scheduler.state(name).up != before

    def report_load(
        self,
        name: str,
        running: float,
        waiting: float,
        kv: float | None,
        prefix_queries: float | None = None,
        prefix_hits: float | None = None,
        cache_tokens: int | None = None,
    ) -> None:
        report = LoadReport(
            running, waiting, kv, self.clock(), prefix_queries, prefix_hits, cache_tokens
        )
        state = self.scheduler.state(name) if self.scheduler.has(name) else None
        before = state.learned_slots if state is not None else None
        self.scheduler.report_load(name, report)
        if state is not None:
            self._take_back(name)
        if state is not None and state.learned_slots != before:
            _log.warning(
                "capacity_learned",
                server=name,
                configured_slots=state.spec.slots,
                learned_slots=state.learned_slots,  # None: back to the configured ones
                running=report.running,
                waiting=report.waiting,
            )

    def _take_back(self, name: str) -> None:
        """Abort our attempts that `name` cannot hold (see Scheduler.overbooked)."""
        held = (self._leases.get(t) for t in self.scheduler.overbooked(name))
        taken = [lease for lease in held if lease is not None and lease.evict()]
        if taken:
            self.metrics.taken_back.labels(name).inc(len(taken))
            _log.warning("requests_taken_back", server=name, requests=len(taken))

    def apply_shared(self, view: SharedView, stagger: float = 0.0) -> None:
        """The other gateway processes' load, queues and speeds (shared.py).

        With `stagger`, requests waiting in our queue are placed after a random delay of
        up to that many seconds rather than at once: every process hears a push in the
        same instant, and if each put a waiting request into the room it freed, they
        would overfill it together. Staggered, the first one's push (a millisecond or
        two) reaches the others before they look.
        """
        if stagger <= 0 or not self.scheduler.queued:
            self._settle(self.scheduler.apply_shared(view, self.clock(), self.rng))
            return
        self._settle(self.scheduler.apply_shared(view, self.clock(), self.rng, place=False))
        if self._place_timer is None:
            delay = self.rng.uniform(0.0, stagger)
            self._place_timer = asyncio.get_running_loop().call_later(delay, self._place_later)

    def _place_later(self) -> None:
        self._place_timer = None
        self.place_waiting()

    def place_waiting(self) -> None:
        """Place (or turn away) what waits and can be now: a health round calls it, since an
        ejection that ran out frees room without a call that says so."""
        self._settle(self.scheduler.place_waiting(self.clock(), self.rng))

    def set_models(self, name: str, models: frozenset[str]) -> None:
        """What `name`'s /v1/models lists now; requests waiting for those models may go."""
        self._settle(self.scheduler.set_models(name, models, self.clock(), self.rng))

    def apply(self, specs: list[InstanceSpec], limits: Limits, policy: HealthPolicy) -> None:
        """A reloaded instance list and limits; queued requests may be placed or refused.

        It takes the scheduler's inputs (fleet/inputs.py's `scheduler_inputs`), not the
        `Config`: the instance list is discovery's as much as the files', and the scheduler
        it hands them to sees no `Config`. A drained instance that stays stays drained; one
        removed is forgotten."""
        self._settle(self.scheduler.apply(specs, limits, policy, self.clock(), self.rng))
        self._drained = {n: t for n, t in self._drained.items() if self.scheduler.has(n)}

    # ------------------------------------------------------------ the core's face
    # What the shell above asks of the scheduler goes through here (issue 44): the
    # proxy, the prober, the shared view and the routes never hold the scheduler.

    def instance_names(self) -> frozenset[str]:
        return self.scheduler.names()

    @property
    def limits(self) -> Limits:
        """The limits the scheduler runs with now (a reload may change them)."""
        return self.scheduler.limits

    @property
    def retry_after(self) -> float:
        """The one Retry-After of the gateway's own 503s (fleet/inputs.py)."""
        return self.scheduler.limits.queue_retry_after

    @property
    def has_prefill_role(self) -> bool:
        """Whether some instance prefills for others (a disaggregated fleet)."""
        return self.scheduler.has_prefill_role

    def knows_model(self, model: str) -> bool:
        return self.scheduler.knows_model(model)

    def model_served(self, model: str) -> bool:
        return self.scheduler.model_served(model)

    def served_models(self) -> list[str]:
        return self.scheduler.served_models()

    def splits(self, ticket: Ticket) -> bool:
        """Whether the core would send `ticket`'s prompt to a prefill instance now."""
        return self.scheduler.splits(ticket, self.clock())

    def untried_available(
        self, lane: Lane, tried: frozenset[str], model: str | None, hop: Hop
    ) -> bool:
        """Whether an instance not in `tried` could take `hop` of a `lane` request now."""
        return self.scheduler.untried_available(lane, tried, self.clock(), model, hop)

    def least_busy_available(self, model: str | None = None) -> str | None:
        """The available instance (of `model`'s, if named) with the fewest of our requests
        (None: none is up)."""
        return self.scheduler.least_busy_available(self.clock(), model)

    def kv_index(self, name: str) -> KvIndex | None:
        """Instance `name`'s KV events index, which its listener feeds (None: it has none)."""
        return self.scheduler.kv_index(name)

    def kv_blocks(self, model: str | None) -> tuple[int, str | None] | None:
        """The block size (and LoRA adapter) to chain a prompt for `model` in, if a KV
        events index could look it up; None: none could (kv_index.py)."""
        return self.scheduler.kv_blocks(model)

    def update_slow_flags(self) -> dict[str, bool]:
        """A health round's look at speeds: the instances whose slow flag changed."""
        return self.scheduler.update_slow_flags()

    def local_share(self) -> LocalShare:
        """What this process holds now, for the shared view (shared.py)."""
        return self.scheduler.share(self.clock())

    def take_placements(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.scheduler.take_placements()

    def take_settled(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.scheduler.take_settled()

    def learn_placements(self, placements: Iterable[tuple[str, Sequence[int]]]) -> None:
        self.scheduler.learn_placements(placements)

    def learn_settled(self, settled: Iterable[tuple[str, Sequence[int]]]) -> None:
        self.scheduler.learn_settled(settled)

    @property
    def drained(self) -> Mapping[str, float]:
        """The instances out of rotation by the operator's order, and since when."""
        return MappingProxyType(self._drained)

    def set_drained(self, drained: Mapping[str, float]) -> None:
        """The operator's drains now: these instances out of rotation, every other in."""
        self._drained = dict(drained)
        self._settle(self.scheduler.set_drained(self._drained, self.clock(), self.rng))
        self._changed()

    def close(self) -> None:
        """Shutting down: every queued request gets 503 now."""
        self._settle(self.scheduler.close())

    def _settle(self, decisions: list[Decision]) -> None:
        if decisions:  # queued requests placed or refused (a peer's push may free room)
            self._changed()
        if self.scheduler.limits.peer_yield and self._place_timer is None:
            # A place left to a peer's key is filled when the wait runs out, whatever
            # else happens meanwhile (fairness across replicas).
            now = self.clock()
            end = self.scheduler.yield_ends(now)
            if end is not None:
                delay = max(0.0, end - now) + 0.001
                self._place_timer = asyncio.get_running_loop().call_later(delay, self._place_later)
        for decision in decisions:
            future = self._waiters.get(decision.ticket.id)
            if future is None or future.done():
                if isinstance(decision, Assigned):  # nobody waits for it any more
                    self.release(decision.ticket.id, Outcome.NEUTRAL)
                continue
            if isinstance(decision, Assigned):
                future.set_result(decision.instance)
            elif isinstance(decision, Rejected):
                future.set_exception(self._rejection(decision))

    def _rejection(self, decision: Rejected) -> errors.GatewayError:
        self.metrics.rejections.labels(decision.reason).inc()
        error = self._refusal(decision)
        error.rejection = decision.reason
        return error

    def _refusal(self, decision: Rejected) -> errors.GatewayError:
        after = decision.retry_after
        if decision.reason == "queue_full":
            return errors.Overloaded(
                "every instance is at its queue limit and the gateway queue is full; "
                "retry after the delay in Retry-After",
                retry_after=after,
            )
        if decision.reason == "no_instance":
            return errors.NoInstanceAvailable(
                f"no healthy vLLM instance can take a {decision.ticket.lane.value}-lane request "
                "right now",
                retry_after=after,
            )
        if decision.reason == "predicted_wait":
            return errors.Overloaded(
                f"every {decision.ticket.lane.value}-lane instance is at its limit and this "
                "request would wait in the gateway queue past its time; retry after the "
                "delay in Retry-After",
                retry_after=after,
            )
        if decision.reason == "shutting_down":
            return errors.ShuttingDown("the gateway is shutting down", retry_after=after)
        # It never reached an instance (nothing ran on a GPU): the client may retry.
        return errors.QueueTimeout(
            "the request waited in the gateway queue until its time ran out; every "
            f"{decision.ticket.lane.value}-lane instance stayed at its limit",
            retry_after=after,
        )

    def __repr__(self) -> str:
        return f"<Dispatcher waiting={len(self._waiters)} {self.scheduler!r}>"
