"""The scheduler: which instance takes a request, or whether it waits or is turned away.

Pure and synchronous, in the manner of httpcore's connection pool: every method takes
the shell's `now` (and an `rng` where a choice is made), changes the state, and returns
decisions. Decisions about requests that were waiting in the gateway queue come back as
a list from whichever call freed room (`release`, `prefill_done`, `probe`), and the
shell wakes those requests.

Limits an instance holds:
- at most `slots + max_queue_per_instance` of our requests (`slots` is its
  `max_num_seqs`): that is, at most `max_queue_per_instance` waiting beyond what it runs;
  a request that would exceed it goes to another instance (overflow);
- on an instance shared by both lanes, at most `max_long_per_instance` long requests
  still in prefill, so short requests never wait behind a wall of long ones.
When no instance has room, the request waits in a bounded FIFO queue of its lane, for
at most its lane's `max_queue_wait` and never past its deadline; one whose predicted
wait is already longer is refused at arrival (see `admission.py`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import admission, health, speed
from .model import (
    Assigned,
    Decision,
    HealthPolicy,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    Queued,
    Rejected,
    Ticket,
)
from .select import Strategy


class UnknownTicket(KeyError):
    """A ticket id the scheduler does not hold (released twice, or never assigned)."""


@dataclass
class _Held:
    """A request on an instance: whether it is still in prefill, and the work ahead of it."""

    state: InstanceState
    ticket: Ticket
    prefilling: bool = True
    ahead: int = 0  # our prompt tokens in prefill there when it was sent


class Scheduler:
    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        strategy: Strategy,
        limits: Limits = Limits(),
        health_policy: HealthPolicy = HealthPolicy(),
    ) -> None:
        if not specs:
            raise ValueError("a scheduler needs at least one instance")
        self.states = [InstanceState(spec) for spec in specs]
        self.strategy = strategy
        self.limits = limits
        self.health_policy = health_policy
        self.closed = False
        self._by_name = {s.name: s for s in self.states}
        # Where a lane has no dedicated or shared instance, it may use any.
        self._pool = {
            lane: [s for s in self.states if s.serves(lane)] or self.states for lane in Lane
        }
        # Insertion-ordered dicts: FIFO with O(1) removal of a ticket whose client left.
        self._queues: dict[Lane, dict[int, Ticket]] = {lane: {} for lane in Lane}
        # Retries wait apart: each may only go to instances it has not tried, so in the
        # FIFO one of them could head its lane and block requests an idle instance could run.
        self._retries: dict[int, Ticket] = {}
        self._holding: dict[int, _Held] = {}
        # When each queued ticket leaves the queue unplaced, if nothing places it first.
        self._wait_until: dict[int, float] = {}
        self._throughput = {lane: admission.Throughput() for lane in Lane}

    # ------------------------------------------------------------ queries

    def state(self, name: str) -> InstanceState:
        return self._by_name[name]

    @property
    def inflight(self) -> int:
        return len(self._holding)

    def queue_length(self, lane: Lane) -> int:
        return len(self._queues[lane]) + sum(1 for t in self._retries.values() if t.lane is lane)

    def any_available(self, now: float) -> bool:
        return any(s.available(now) for s in self.states)

    def ahead(self, lane: Lane) -> int:
        """Requests that start before a new `lane` request would: queued, and waiting at
        the lane's instances beyond their running slots."""
        at_instances = sum(max(0, s.inflight - s.spec.slots) for s in self._pool[lane])
        return self.queue_length(lane) + at_instances

    def predicted_wait(self, lane: Lane, now: float) -> float | None:
        """How long a new `lane` request would wait to start (None: rate not known yet)."""
        return admission.predicted_wait(self.ahead(lane), self._throughput[lane].rate(now))

    def untried_available(self, lane: Lane, tried: frozenset[str], now: float) -> bool:
        """Whether a retry of a `lane` request that tried `tried` has anywhere left to go."""
        return any(s.available(now) and s.name not in tried for s in self._pool[lane])

    def _untried_alive(self, ticket: Ticket, now: float) -> bool:
        return self.untried_available(ticket.lane, ticket.exclude, now)

    # ------------------------------------------------------------ requests

    def submit(self, ticket: Ticket, now: float, rng: random.Random) -> Decision:
        """A new request (or a retry): assign it, queue it, or reject it."""
        if self.closed:
            return Rejected(ticket, "shutting_down", self.limits.queue_retry_after)
        if ticket.deadline <= now:
            return Rejected(ticket, "deadline", self.limits.queue_retry_after)
        if not self._lane_alive(ticket.lane, now):
            return Rejected(ticket, "no_instance", self.limits.queue_retry_after)
        queue = self._queues[ticket.lane]
        if ticket.exclude:
            return self._submit_retry(ticket, now, rng)
        if not queue:  # FIFO: nobody may overtake requests already waiting in this lane
            candidates = self._candidates(ticket, now)
            if candidates:
                return self._assign(ticket, candidates, now, rng)
        if len(queue) >= self.limits.gateway_queue_size:
            wait = self.predicted_wait(ticket.lane, now)
            return Rejected(ticket, "queue_full", wait or self.limits.queue_retry_after)
        wait_until = min(ticket.deadline, now + self.limits.max_queue_wait(ticket.lane))
        rate = self._throughput[ticket.lane].rate(now)
        refused = admission.refusal(self.ahead(ticket.lane), rate, wait_until - now)
        if refused is not None:
            return Rejected(ticket, "predicted_wait", refused)
        return self._enqueue(queue, ticket, wait_until)

    def _submit_retry(self, ticket: Ticket, now: float, rng: random.Random) -> Decision:
        """A retry goes to an untried instance with room, or waits apart for one."""
        if not self._untried_alive(ticket, now):
            return Rejected(ticket, "no_instance", self.limits.queue_retry_after)
        candidates = self._candidates(ticket, now)
        if candidates:
            return self._assign(ticket, candidates, now, rng)
        if len(self._retries) >= self.limits.gateway_queue_size:
            return Rejected(ticket, "queue_full", self.limits.queue_retry_after)
        # A retry was admitted once already; it waits apart, bounded like any other.
        wait_until = min(ticket.deadline, now + self.limits.max_queue_wait(ticket.lane))
        return self._enqueue(self._retries, ticket, wait_until)

    def _enqueue(self, queue: dict[int, Ticket], ticket: Ticket, wait_until: float) -> Queued:
        queue[ticket.id] = ticket
        self._wait_until[ticket.id] = wait_until
        return Queued(ticket, len(queue), wait_until)

    def cancel(self, ticket_id: int) -> bool:
        """Drop a queued request whose client left; False if it is not queued (any more)."""
        self._wait_until.pop(ticket_id, None)
        if self._retries.pop(ticket_id, None) is not None:
            return True
        return any(q.pop(ticket_id, None) is not None for q in self._queues.values())

    def expire(self, ticket_id: int, now: float) -> list[Decision]:
        """A queued request's wait ran out: reject it (503, it never reached an instance).

        Returns nothing if it is no longer queued, or if its time has not come yet (the
        shell's timer may run a little early; it asks again).
        """
        wait_until = self._wait_until.get(ticket_id)
        if wait_until is None or wait_until > now:
            return []
        ticket = next(
            q[ticket_id] for q in (self._retries, *self._queues.values()) if ticket_id in q
        )
        self.cancel(ticket_id)
        return [Rejected(ticket, "deadline", self.limits.queue_retry_after)]

    def wait_until(self, ticket_id: int) -> float | None:
        return self._wait_until.get(ticket_id)

    def prefill_done(
        self, ticket_id: int, now: float, rng: random.Random, ttft: float | None = None
    ) -> list[Decision]:
        """The first token arrived `ttft` s after the request was sent to its instance.

        The request's prompt leaves the instance's prefill work; the time teaches the
        instance's prefill rate; a long request gives up its long-prefill place.
        """
        held = self._holding.get(ticket_id)
        if held is None or not held.prefilling:
            return []
        self._end_prefill(held, now)
        if ttft is not None:
            held.state.speed.observe_prefill(held.ahead + held.ticket.tokens, ttft)
        return self._drain(now, rng) if held.ticket.lane is Lane.LONG else []

    def observe_tpot(self, name: str, seconds: float) -> None:
        """A streamed answer's time per output token on `name`."""
        self._by_name[name].speed.observe_tpot(seconds)

    def update_slow_flags(self) -> dict[str, bool]:
        """Re-evaluate which instances are slow cards; return the flags that changed."""
        return speed.update_slow_flags({s.name: s.speed for s in self.states})

    def release(
        self,
        ticket_id: int,
        outcome: Outcome,
        now: float,
        rng: random.Random,
        error: str | None = None,
    ) -> list[Decision]:
        """A request left its instance (done, failed or cancelled); hand its place on."""
        try:
            held = self._holding.pop(ticket_id)
        except KeyError:
            raise UnknownTicket(ticket_id) from None
        if held.prefilling:
            self._end_prefill(held, now)
        if not self._departs_at_prefill(held):
            self._throughput[held.ticket.lane].record(now)
        held.state.inflight -= 1
        health.apply_outcome(held.state, outcome, now, self.health_policy, self.states, error)
        return self._drain(now, rng)

    def _end_prefill(self, held: _Held, now: float) -> None:
        held.prefilling = False
        held.state.pending_prefill_tokens -= held.ticket.tokens
        if held.ticket.lane is Lane.LONG:
            held.state.long_prefilling -= 1
            if self._departs_at_prefill(held):
                self._throughput[Lane.LONG].record(now)

    @staticmethod
    def _departs_at_prefill(held: _Held) -> bool:
        """A long request on a shared instance lets the next one in when its prefill ends
        (`max_long_per_instance`); every other request when it leaves its slot."""
        return held.ticket.lane is Lane.LONG and held.state.spec.lane == "any"

    def holder(self, ticket_id: int) -> str | None:
        held = self._holding.get(ticket_id)
        return held.state.name if held else None

    # ------------------------------------------------------------ instances

    def probe(self, name: str, ok: bool, now: float, rng: random.Random) -> list[Decision]:
        """An active health probe answered (or failed)."""
        state = self._by_name[name]
        changed = health.apply_probe(state, ok, self.health_policy)
        # Also drain when nothing changed: an ejection may have run out since.
        return self._drain(now, rng) if changed or self._any_queued() else []

    def report_load(self, name: str, report: LoadReport) -> None:
        state = self._by_name[name]
        state.report = report
        state.inflight_at_report = state.inflight

    def close(self) -> list[Decision]:
        """Shutting down: refuse new requests and turn away every queued one."""
        self.closed = True
        out: list[Decision] = []
        for queue in (*self._queues.values(), self._retries):
            out += [
                Rejected(t, "shutting_down", self.limits.queue_retry_after) for t in queue.values()
            ]
            queue.clear()
        self._wait_until.clear()
        return out

    # ------------------------------------------------------------ internals

    def _any_queued(self) -> bool:
        return bool(self._retries) or any(self._queues.values())

    def _lane_alive(self, lane: Lane, now: float) -> bool:
        return any(s.available(now) for s in self._pool[lane])

    def _has_room(self, state: InstanceState, lane: Lane) -> bool:
        if state.inflight >= state.spec.slots + self.limits.max_queue_per_instance:
            return False
        if lane is Lane.LONG and state.spec.lane == "any":
            return state.long_prefilling < self.limits.max_long_per_instance
        return True

    def _candidates(self, ticket: Ticket, now: float) -> list[InstanceState]:
        limit = self.limits.global_limit
        if limit is not None and len(self._holding) >= limit:
            return []
        pool = [
            s
            for s in self._pool[ticket.lane]
            if s.available(now) and self._has_room(s, ticket.lane)
        ]
        # A retry goes only to instances it has not tried; the shell checks that one
        # exists (`untried_available`) before it retries. Prefer one that did not just
        # answer "busy".
        untried = [s for s in pool if s.name not in ticket.exclude] if ticket.exclude else pool
        fresh = [s for s in untried if not s.busy(now)]
        return fresh or untried

    def _assign(
        self, ticket: Ticket, candidates: Sequence[InstanceState], now: float, rng: random.Random
    ) -> Assigned:
        state = self.strategy.choose(candidates, self.states, ticket, now, rng)
        self._holding[ticket.id] = _Held(state, ticket, ahead=state.pending_prefill_tokens)
        state.inflight += 1
        state.assigned_total += 1
        state.pending_prefill_tokens += ticket.tokens
        if ticket.lane is Lane.LONG:
            state.long_prefilling += 1
        return Assigned(ticket, state.name)

    def _drain(self, now: float, rng: random.Random) -> list[Decision]:
        """Place queued requests while any lane's head fits somewhere, oldest head first."""
        out: list[Decision] = []
        for lane, queue in self._queues.items():
            if queue and not self._lane_alive(lane, now):
                out += [
                    Rejected(t, "no_instance", self.limits.queue_retry_after)
                    for t in queue.values()
                ]
                for ticket_id in queue:
                    self._wait_until.pop(ticket_id, None)
                queue.clear()
        for ticket in list(self._retries.values()):
            if not self._untried_alive(ticket, now):
                self.cancel(ticket.id)
                out.append(Rejected(ticket, "no_instance", self.limits.queue_retry_after))
        while True:
            # Retries first (they waited longest, counting their failed attempt), each on
            # its own: one that cannot be placed does not hold up the others.
            heads = list(self._retries.values()) + sorted(
                (next(iter(q.values())) for q in self._queues.values() if q), key=lambda t: t.id
            )
            placed = False
            for ticket in heads:
                if self._wait_until[ticket.id] <= now:
                    self.cancel(ticket.id)
                    out.append(Rejected(ticket, "deadline", self.limits.queue_retry_after))
                    placed = True
                    break
                candidates = self._candidates(ticket, now)
                if candidates:
                    self.cancel(ticket.id)
                    out.append(self._assign(ticket, candidates, now, rng))
                    placed = True
                    break
            if not placed:
                return out

    def queued_tickets(self) -> Iterable[Ticket]:
        yield from self._retries.values()
        for queue in self._queues.values():
            yield from queue.values()

    def __repr__(self) -> str:
        queues = " ".join(f"{lane.value}={len(q)}" for lane, q in self._queues.items())
        return (
            f"<Scheduler {self.strategy.name} inflight={self.inflight} queued {queues} "
            f"retries={len(self._retries)}>"
        )
