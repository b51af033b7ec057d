"""The property test's independent model of the scheduler: a record of the tickets it
holds, queues and has decided, the checks every decision it returns must pass, and the
invariants its whole state must keep after each step and at close."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from _sched_helpers import holder, inflight_of, queue_length_of, queued_tickets, ticket_state
from _sched_ops import Setup

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    Decision,
    InstanceState,
    Lane,
    Limits,
    Outcome,
    Queued,
    Rejected,
    Scheduler,
    Ticket,
)
from gateway.dispatch.ticket_state import TicketState

# ------------------------------------------------------------------ model and checks


@dataclass
class Model:
    """The scheduler under test plus an independent record of what it promised."""

    setup: Setup
    sched: Scheduler = field(init=False)
    rng: random.Random = field(init=False)
    now: float = 0.0
    next_id: int = 1
    held: dict[int, tuple[str, Lane, bool]] = field(default_factory=dict)  # inst, lane, prefill
    first_token: set[int] = field(default_factory=set)  # held ones told prefill_done
    queued: dict[Lane, dict[int, Ticket]] = field(
        default_factory=lambda: {lane: {} for lane in Lane}
    )
    retries: dict[int, Ticket] = field(default_factory=dict)  # retries waiting apart
    final: dict[int, Decision] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)
    ever_queued: set[int] = field(default_factory=set)
    wait_until: dict[int, float] = field(default_factory=dict)  # when a queued one expires

    def __post_init__(self) -> None:
        s = self.setup
        self.rng = random.Random(s.seed)
        self.sched = Scheduler(
            s.specs, STRATEGIES[s.strategy](s.limits.metrics_stale_after), s.limits, s.policy
        )
        for spec, up in zip(s.specs, s.initially_up, strict=True):
            if up:
                self.settle(self.sched.probe(spec.name, True, self.now, self.rng), drained=True)
        self.check()

    # ---------------------------------------------------------------- helpers

    @property
    def limits(self) -> Limits:
        return self.setup.limits

    def eligible(self, lane: Lane) -> list[InstanceState]:
        serving = [s for s in self.sched.instances.states if s.serves(lane)]
        return serving or list(self.sched.instances.states)

    def has_room(self, state: InstanceState, lane: Lane) -> bool:
        """Recomputed from the spec and the slots the instance showed it runs (its learned
        capacity, which test_learned_capacity.py checks), independently of the scheduler's
        fleet's own `_has_room`. From the spec alone, a report of fewer running than placed made
        the model see room the scheduler rightly did not."""
        if not state.available(self.now) or state not in self.eligible(lane):
            return False
        if state.inflight >= state.slots + self.limits.max_queue_per_instance:
            return False
        if lane is Lane.LONG and self.capped(state):
            return state.long_prefilling < self.limits.max_long_per_instance
        return True

    def capped(self, state: InstanceState) -> bool:
        """Long requests there are bounded: on a shared instance."""
        return state.spec.lane == "any"

    def fits_somewhere(self, ticket: Ticket) -> bool:
        """Whether some instance may take `ticket` now (a retry never goes where it was)."""
        limit = self.limits.global_limit
        if limit is not None and len(self.held) >= limit:
            return False
        return any(
            self.has_room(s, ticket.lane) for s in self.allowed(ticket, self.sched.instances.states)
        )

    def lane_alive(self, lane: Lane) -> bool:
        return any(s.available(self.now) for s in self.eligible(lane))

    def record_final(self, decision: Decision) -> None:
        tid = decision.ticket.id
        assert tid not in self.final, f"ticket {tid} decided twice: {self.final[tid]}, {decision}"
        assert tid not in self.cancelled, f"cancelled ticket {tid} decided: {decision}"
        self.final[tid] = decision

    def check_assigned(self, decision: Assigned) -> None:
        state = self.sched.state(decision.instance)
        lane = decision.ticket.lane
        assert state.available(self.now), f"{decision} went to an unavailable {state!r}"
        assert state in self.eligible(lane), f"{decision} went to {state!r}, not serving {lane}"
        if lane is Lane.LONG and self.capped(state):
            assert state.long_prefilling <= self.limits.max_long_per_instance, state
        self.held[decision.ticket.id] = (decision.instance, lane, lane is Lane.LONG)

    def check_preference(self, d: Assigned) -> None:
        """A retry never returns to an instance it tried; one that just said busy is a last resort.

        Checked after the call: room only shrinks within one call, so an instance with room
        now had room when the choice was made.
        """
        exclude = d.ticket.exclude
        others = [s for s in self.sched.instances.states if s.name != d.instance]
        chosen = self.sched.state(d.instance)
        lane = d.ticket.lane
        assert d.instance not in exclude, f"{d} went back to an instance it tried"
        if chosen.busy(self.now):
            assert not any(
                self.has_room(s, lane) and not s.busy(self.now)
                for s in self.allowed(d.ticket, others)
            ), d

    def allowed(self, ticket: Ticket, states: Sequence[InstanceState]) -> list[InstanceState]:
        """Of `states`, those `ticket` may go to, room aside: the untried ones."""
        return [s for s in states if s.name not in ticket.exclude]

    # ---------------------------------------------------------------- applying decisions

    def settle(self, decisions: Sequence[Decision], *, drained: bool) -> None:
        """Check the decisions a call returned, in order; only a draining call may return any."""
        for d in decisions:
            assert drained, f"unexpected decision {d}"
            if d.ticket.exclude:
                self.settle_retry(d)
                continue
            lane_queue = self.queued[d.ticket.lane]
            assert d.ticket.id in lane_queue, f"decision for a ticket not waiting: {d}"
            head = next(iter(lane_queue))
            if isinstance(d, Assigned):
                # FIFO within a lane: only the oldest waiting ticket may be placed.
                assert d.ticket.id == head, f"{d} overtook ticket {head} in its lane"
                self.check_assigned(d)
                self.check_preference(d)
            elif isinstance(d, Rejected):
                if d.reason == "deadline":
                    assert d.ticket.id == head
                    assert self.wait_until[d.ticket.id] <= self.now
                elif d.reason == "no_instance":
                    assert not self.lane_alive(d.ticket.lane)
                else:
                    raise AssertionError(f"unexpected rejection from a drain: {d}")
            else:
                raise AssertionError(f"a drain queued a ticket: {d}")
            del lane_queue[d.ticket.id]
            self.record_final(d)
        if drained:
            # Work-conserving: after a drain no waiting retry and no lane's oldest waiter
            # fits anywhere.
            for retry in self.retries.values():
                assert not self.fits_somewhere(retry), f"retry {retry} waits with room"
            for lane, queue in self.queued.items():
                if queue:
                    head_ticket = next(iter(queue.values()))
                    assert not self.fits_somewhere(head_ticket), f"{lane} head waits with room"

    def settle_retry(self, d: Decision) -> None:
        """A waiting retry may be placed out of FIFO order, only on an untried instance."""
        assert d.ticket.id in self.retries, f"decision for a retry not waiting: {d}"
        if isinstance(d, Assigned):
            self.check_assigned(d)
            self.check_preference(d)
        elif isinstance(d, Rejected):
            if d.reason == "deadline":
                assert self.wait_until[d.ticket.id] <= self.now
            elif d.reason == "no_instance":
                assert not self.untried_alive(d.ticket)
            else:
                raise AssertionError(f"unexpected rejection of a retry: {d}")
        else:
            raise AssertionError(f"a drain queued a retry: {d}")
        del self.retries[d.ticket.id]
        self.record_final(d)

    def expect_wait_until(self, d: Queued) -> None:
        """A queued ticket waits until its deadline, or max_queue_wait if that comes first."""
        budget = self.limits.max_queue_wait(d.ticket.lane)
        assert d.wait_until == min(d.ticket.deadline, self.now + budget)
        self.wait_until[d.ticket.id] = d.wait_until

    def untried_alive(self, ticket: Ticket) -> bool:
        return any(
            s.available(self.now) and s.name not in ticket.exclude
            for s in self.eligible(ticket.lane)
        )

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        limits = self.limits
        for state in self.sched.instances.states:
            mine = [h for h in self.held.values() if h[0] == state.name]
            assert 0 <= state.inflight <= state.spec.slots + limits.max_queue_per_instance
            assert state.inflight == len(mine), state
            assert state.long_prefilling >= 0, state
            assert state.long_prefilling == sum(1 for h in mine if h[2]), state
        total = sum(s.inflight for s in self.sched.instances.states)
        assert total == inflight_of(self.sched) == len(self.held)
        if limits.global_limit is not None:
            assert inflight_of(self.sched) <= limits.global_limit
        for tid, (name, _, _) in self.held.items():
            assert holder(self.sched, tid) == name
            # Its life by the state table: decoding once its first token came.
            want = TicketState.DECODING if tid in self.first_token else TicketState.PREFILLING
            assert ticket_state(self.sched, tid) is want, (tid, want)
        waiting = [tid for q in self.queued.values() for tid in q] + list(self.retries)
        assert all(ticket_state(self.sched, tid) is TicketState.QUEUED for tid in waiting)
        # Refused, cancelled or released: forgotten, new again to the scheduler.
        gone = self.cancelled | {tid for tid in self.final if tid not in self.held}
        assert all(ticket_state(self.sched, tid) is TicketState.NEW for tid in gone)
        assert len(self.retries) <= limits.gateway_queue_size
        assert {t.id for t in queued_tickets(self.sched) if t.exclude} == set(self.retries)
        for lane, queue in self.queued.items():
            retries = sum(1 for t in self.retries.values() if t.lane is lane)
            assert queue_length_of(self.sched, lane) == len(queue) + retries
            assert len(queue) <= limits.gateway_queue_size
            actual = [t.id for t in queued_tickets(self.sched) if t.lane is lane and not t.exclude]
            assert actual == list(queue), f"{lane} queue {actual} != model {list(queue)}"
            # Requests never wait for a lane with no instance that could serve them.
            assert not queue or self.lane_alive(lane), f"{lane} waiters with no instance"

    def finish(self) -> None:
        """Close: waiters and later submits are turned away; every ticket had exactly one fate."""
        out = self.sched.close()
        waiting = {tid for q in self.queued.values() for tid in q} | set(self.retries)
        assert {d.ticket.id for d in out} == waiting
        for d in out:
            assert isinstance(d, Rejected)
            assert d.reason == "shutting_down"
            self.record_final(d)
        for q in self.queued.values():
            q.clear()
        self.retries.clear()
        self.check()
        for lane in Lane:
            late = self.sched.submit(Ticket(self.next_id, lane, 1e9), self.now, self.rng)
            self.next_id += 1
            assert isinstance(late, Rejected)
            assert late.reason == "shutting_down"
        for tid in self.ever_queued:
            assert (tid in self.final) != (tid in self.cancelled), tid
        for tid in sorted(self.held):
            del self.held[tid]
            assert self.sched.release(tid, Outcome.SUCCESS, self.now, self.rng) == []
            self.check()
        assert inflight_of(self.sched) == 0
        assert all(s.long_prefilling == 0 for s in self.sched.instances.states)
