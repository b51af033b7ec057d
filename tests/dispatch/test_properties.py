"""Invariants of the scheduler under random operation sequences (hypothesis, no event loop).

Each example draws a fleet and limits, then replays a list of operations against the
scheduler while a small independent model tracks which tickets are held and queued. After
every step the scheduler's state is checked against the invariants and against the model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch import (
    STRATEGIES,
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
    Scheduler,
    Ticket,
    UnknownTicket,
)

# ------------------------------------------------------------------ operations


@dataclass(frozen=True)
class Submit:
    lane: Lane
    patience: float  # deadline = now + patience; 0 is already expired
    exclude_mask: int  # bit k excludes instance k, as a retry would


@dataclass(frozen=True)
class Release:
    pick: int
    outcome: Outcome


@dataclass(frozen=True)
class PrefillDone:
    pick: int


@dataclass(frozen=True)
class Probe:
    instance: int
    ok: bool


@dataclass(frozen=True)
class Cancel:
    pick: int


@dataclass(frozen=True)
class Advance:
    seconds: float


@dataclass(frozen=True)
class Report:
    instance: int
    running: int
    waiting: int


@dataclass(frozen=True)
class UpdateLanes:
    """A health round's look at the split between the lanes."""


Op = Submit | Release | PrefillDone | Probe | Cancel | Advance | Report | UpdateLanes

picks = st.integers(0, 63)
instances = st.integers(0, 3)
submits = st.builds(
    Submit,
    st.sampled_from(list(Lane)),
    st.sampled_from([0.0, 1.0, 3.0, 30.0, 1e9, 1e9, 1e9, 1e9]),
    st.integers(0, 15) | st.just(0),
)
releases = st.builds(Release, picks, st.sampled_from(list(Outcome)))
# Listed more than once to weight the mix toward traffic: one_of picks branches uniformly.
ops = st.one_of(
    submits,
    submits,
    submits,
    submits,
    releases,
    releases,
    st.builds(PrefillDone, picks),
    st.builds(Probe, instances, st.sampled_from([True, True, False])),
    st.builds(Cancel, picks),
    st.builds(Advance, st.sampled_from([0.5, 2.0, 7.0])),
    st.builds(Report, instances, st.integers(0, 20), st.integers(0, 20)),
    st.just(UpdateLanes()),
    st.just(UpdateLanes()),
)
operation_lists = st.lists(ops, min_size=40, max_size=150)


@dataclass(frozen=True)
class Setup:
    specs: tuple[InstanceSpec, ...]
    limits: Limits
    policy: HealthPolicy
    strategy: str
    initially_up: tuple[bool, ...]
    seed: int


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    n = draw(st.integers(1, 4))
    specs = tuple(
        InstanceSpec(
            f"i{k}",
            lane=draw(st.sampled_from(["short", "long", "any"])),
            slots=draw(st.integers(1, 4)),
            weight=draw(st.sampled_from([1.0, 2.0])),
        )
        for k in range(n)
    )
    limits = Limits(
        max_queue_per_instance=draw(st.integers(0, 3)),
        max_long_per_instance=draw(st.integers(1, 2)),
        gateway_queue_size=draw(st.integers(0, 5)),
        global_limit=draw(st.none() | st.integers(1, 8)),
        metrics_stale_after=5.0,
        max_queue_wait_short=draw(st.sampled_from([math.inf, 1.0, 4.0])),
        max_queue_wait_long=draw(st.sampled_from([math.inf, 3.0])),
        lane_split=draw(st.booleans()),
    )
    policy = HealthPolicy(
        rise=draw(st.integers(1, 2)),
        fall=draw(st.integers(1, 2)),
        eject_after_failures=draw(st.integers(1, 3)),
        ejection_base=draw(st.sampled_from([1.0, 5.0])),
        ejection_max=20.0,
        max_ejected_fraction=draw(st.sampled_from([0.25, 0.5, 1.0])),
        busy_penalty=draw(st.sampled_from([0.5, 3.0])),
    )
    return Setup(
        specs=specs,
        limits=limits,
        policy=policy,
        strategy=draw(st.sampled_from(sorted(STRATEGIES))),
        initially_up=tuple(draw(st.sampled_from([True, True, True, False])) for _ in specs),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ------------------------------------------------------------------ model and checks


@dataclass
class Harness:
    """The scheduler under test plus an independent record of what it promised."""

    setup: Setup
    sched: Scheduler = field(init=False)
    rng: random.Random = field(init=False)
    now: float = 0.0
    next_id: int = 1
    held: dict[int, tuple[str, Lane, bool]] = field(default_factory=dict)  # inst, lane, prefill
    queued: dict[Lane, dict[int, Ticket]] = field(
        default_factory=lambda: {lane: {} for lane in Lane}
    )
    retries: dict[int, Ticket] = field(default_factory=dict)  # retries waiting apart
    final: dict[int, Decision] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)
    ever_queued: set[int] = field(default_factory=set)
    wait_until: dict[int, float] = field(default_factory=dict)  # when a queued one expires
    # Which lane holds each shared instance, from the moves update_lanes reported.
    lanes: dict[str, Lane] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.setup
        self.rng = random.Random(s.seed)
        self.lanes = {spec.name: Lane.SHORT for spec in s.specs if spec.lane == "any"}
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

    def pool(self, lane: Lane) -> list[InstanceState]:
        serving = [s for s in self.sched.states if s.serves(lane)]
        return serving or list(self.sched.states)

    def has_room(self, state: InstanceState, lane: Lane) -> bool:
        """Recomputed from the spec, independently of the scheduler's own `_has_room`."""
        if not state.available(self.now) or state not in self.pool(lane):
            return False
        if state.inflight >= state.spec.slots + self.limits.max_queue_per_instance:
            return False
        if lane is Lane.LONG and self.capped(state):
            return state.long_prefilling < self.limits.max_long_per_instance
        return True

    def serves_now(self, state: InstanceState) -> str:
        """The lane `state` serves now by the model: static, held, or "any" (split off)."""
        if state.spec.lane != "any" or not self.limits.lane_split:
            return state.spec.lane
        return self.lanes[state.name].value

    def capped(self, state: InstanceState) -> bool:
        """Long requests there are bounded: on a shared instance, whatever lane it holds."""
        return state.spec.lane == "any"

    def fits_somewhere(self, ticket: Ticket) -> bool:
        """Whether some instance may take `ticket` now (a retry never goes where it was)."""
        limit = self.limits.global_limit
        if limit is not None and len(self.held) >= limit:
            return False
        return any(self.has_room(s, ticket.lane) for s in self.allowed(ticket, self.sched.states))

    def lane_alive(self, lane: Lane) -> bool:
        return any(s.available(self.now) for s in self.pool(lane))

    def record_final(self, decision: Decision) -> None:
        tid = decision.ticket.id
        assert tid not in self.final, f"ticket {tid} decided twice: {self.final[tid]}, {decision}"
        assert tid not in self.cancelled, f"cancelled ticket {tid} decided: {decision}"
        self.final[tid] = decision

    def check_assigned(self, decision: Assigned) -> None:
        state = self.sched.state(decision.instance)
        lane = decision.ticket.lane
        assert state.available(self.now), f"{decision} went to an unavailable {state!r}"
        assert state in self.pool(lane), f"{decision} went to {state!r}, not serving {lane}"
        if lane is Lane.LONG and self.capped(state):
            assert state.long_prefilling <= self.limits.max_long_per_instance, state
        self.held[decision.ticket.id] = (decision.instance, lane, lane is Lane.LONG)

    def check_preference(self, d: Assigned) -> None:
        """A retry never returns to an instance it tried; one that just said busy is a last resort.

        Checked after the call: room only shrinks within one call, so an instance with room
        now had room when the choice was made.
        """
        exclude = d.ticket.exclude
        others = [s for s in self.sched.states if s.name != d.instance]
        chosen = self.sched.state(d.instance)
        lane = d.ticket.lane
        assert d.instance not in exclude, f"{d} went back to an instance it tried"
        if self.serves_now(chosen) not in (lane.value, "any"):
            # It spilled to the other lane: none of its own lane's instances had room (a
            # short request: a free running slot); a busy one of its own may lose to a
            # fresh one of the other lane.
            assert not any(
                self.has_room(s, lane)
                and (lane is Lane.LONG or s.inflight < s.spec.slots)
                and s.name not in exclude
                and self.serves_now(s) in (lane.value, "any")
                and (chosen.busy(self.now) or not s.busy(self.now))
                for s in others
            ), f"{d} spilled to the other lane although its own had a free slot"
        if chosen.busy(self.now):
            assert not any(
                self.has_room(s, lane) and not s.busy(self.now)
                for s in self.allowed(d.ticket, others)
            ), d

    def allowed(self, ticket: Ticket, states: Sequence[InstanceState]) -> list[InstanceState]:
        """Of `states`, those `ticket` may go to, room aside: untried ones, and for a long
        request only its own lane's while an instance holding the long lane is up."""
        untried = [s for s in states if s.name not in ticket.exclude]
        if ticket.lane is Lane.LONG and any(
            self.serves_now(s) == "long" and s.available(self.now) and s.name not in ticket.exclude
            for s in self.pool(Lane.LONG)
        ):
            return [s for s in untried if self.serves_now(s) in ("long", "any")]
        return untried

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
            s.available(self.now) and s.name not in ticket.exclude for s in self.pool(ticket.lane)
        )

    # ---------------------------------------------------------------- operations

    def submit(self, op: Submit) -> None:
        tid = self.next_id
        self.next_id += 1
        exclude = frozenset(
            s.name for k, s in enumerate(self.setup.specs) if op.exclude_mask >> k & 1
        )
        # Prompt sizes of each lane, so that the split sees a mix to size itself by.
        tokens = 5000 if op.lane is Lane.LONG else 100
        ticket = Ticket(tid, op.lane, self.now + op.patience, exclude, tokens, 16)
        lane_queue = self.queued[op.lane]
        waiting_before = len(lane_queue)
        room = self.fits_somewhere(ticket)
        d = self.sched.submit(ticket, self.now, self.rng)
        assert d.ticket == ticket
        if isinstance(d, Assigned):
            # Only a retry may pass waiting tickets: it waits apart from the FIFO.
            if not ticket.exclude:
                assert waiting_before == 0, f"{d} overtook {waiting_before} waiting tickets"
            self.check_assigned(d)
            self.check_preference(d)
            self.record_final(d)
        elif isinstance(d, Queued) and ticket.exclude:
            assert self.untried_alive(ticket)
            assert not room, f"retry {d} queued although an untried instance had room"
            assert len(self.retries) < self.limits.gateway_queue_size
            self.retries[tid] = ticket
            self.expect_wait_until(d)
            self.ever_queued.add(tid)
        elif isinstance(d, Queued):
            assert self.lane_alive(op.lane)
            assert ticket.deadline > self.now
            assert waiting_before > 0 or not room, f"{d} although an instance had room"
            assert waiting_before < self.limits.gateway_queue_size
            lane_queue[tid] = ticket
            self.expect_wait_until(d)
            self.ever_queued.add(tid)
            assert d.position == len(lane_queue)
        else:
            if d.reason == "deadline":
                assert ticket.deadline <= self.now
            elif d.reason == "no_instance":
                assert not self.lane_alive(op.lane) or (
                    ticket.exclude and not self.untried_alive(ticket)
                ), d
            elif d.reason == "queue_full" and ticket.exclude:
                assert len(self.retries) == self.limits.gateway_queue_size
                assert not room
            elif d.reason == "queue_full":
                assert waiting_before == self.limits.gateway_queue_size
                assert waiting_before > 0 or not room
            elif d.reason == "predicted_wait":
                # Admission: it would have queued, and its predicted wait is over budget.
                assert not ticket.exclude
                assert waiting_before > 0 or not room
                budget = min(ticket.deadline, self.now + self.limits.max_queue_wait(op.lane))
                wait = self.sched.predicted_wait(op.lane, self.now, ticket.model)
                assert wait is not None
                assert wait > budget - self.now, (wait, budget)
            else:
                raise AssertionError(f"unexpected rejection {d}")
            assert d.retry_after > 0
            self.record_final(d)

    def release(self, op: Release) -> None:
        if not self.held:
            with pytest.raises(UnknownTicket):
                self.sched.release(self.next_id + 1000, op.outcome, self.now, self.rng)
            return
        tid = sorted(self.held)[op.pick % len(self.held)]
        state = self.sched.state(self.held.pop(tid)[0])
        ejections_before = state.ejections_total
        was_available = state.available(self.now)
        out = self.sched.release(tid, op.outcome, self.now, self.rng)
        ejected = was_available and not state.available(self.now)
        if ejected:
            assert state.ejections_total == ejections_before + 1
            # The panic threshold: never the last available one, never beyond the fraction.
            assert op.outcome is Outcome.FAILURE
            states = self.sched.states
            assert any(s.available(self.now) for s in states), "ejected the last instance"
            out_now = sum(1 for s in states if not s.available(self.now))
            assert out_now <= self.setup.policy.max_ejected_fraction * len(states)
        if op.outcome is Outcome.BUSY:
            assert state.busy(self.now)
            assert state.busy_until == self.now + self.setup.policy.busy_penalty
        self.settle(out, drained=True)

    def prefill_done(self, op: PrefillDone) -> None:
        if not self.held:
            assert self.sched.prefill_done(self.next_id + 1000, self.now, self.rng) == []
            return
        tid = sorted(self.held)[op.pick % len(self.held)]
        name, lane, prefilling = self.held[tid]
        out = self.sched.prefill_done(tid, self.now, self.rng)
        if not prefilling:
            assert out == []
            return
        self.held[tid] = (name, lane, False)
        self.settle(out, drained=True)

    def probe(self, op: Probe) -> None:
        if op.instance >= len(self.setup.specs):
            return
        name = self.setup.specs[op.instance].name
        # Every probe drains, so an instance whose ejection ran out picks up waiters.
        self.settle(self.sched.probe(name, op.ok, self.now, self.rng), drained=True)

    def cancel(self, op: Cancel) -> None:
        waiting = [tid for q in self.queued.values() for tid in q] + list(self.retries)
        choices = sorted(waiting) + sorted(self.held) + [self.next_id + 1000]
        tid = choices[op.pick % len(choices)]
        removed = self.sched.cancel(tid)
        assert removed is (tid in waiting)
        if removed:
            for q in self.queued.values():
                q.pop(tid, None)
            self.retries.pop(tid, None)
            self.cancelled.add(tid)

    def report(self, op: Report) -> None:
        if op.instance < len(self.setup.specs):
            name = self.setup.specs[op.instance].name
            load = LoadReport(op.running, op.waiting, kv_usage=op.running / 40, at=self.now)
            self.sched.report_load(name, load)

    def update_lanes(self) -> None:
        before = dict(self.lanes)
        moves, out = self.sched.update_lanes(self.now, self.rng)
        assert len(moves) <= 2, f"moved more than two instances at once: {moves}"
        if len(moves) == 2:  # a swap: one each way
            assert set(moves.values()) == set(Lane), moves
        for name, lane in moves.items():
            assert name in before, f"moved {name}, not a shared instance"
            assert before[name] is not lane, f"moved {name} to the lane it was in"
        self.lanes.update(moves)
        self.settle(out, drained=True)

    def step(self, op: Op) -> None:
        if isinstance(op, Submit):
            self.submit(op)
        elif isinstance(op, Release):
            self.release(op)
        elif isinstance(op, PrefillDone):
            self.prefill_done(op)
        elif isinstance(op, Probe):
            self.probe(op)
        elif isinstance(op, Cancel):
            self.cancel(op)
        elif isinstance(op, Advance):
            self.now += op.seconds
        elif isinstance(op, UpdateLanes):
            self.update_lanes()
        else:
            self.report(op)
        self.check()

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        limits = self.limits
        for state in self.sched.states:
            mine = [h for h in self.held.values() if h[0] == state.name]
            assert 0 <= state.inflight <= state.spec.slots + limits.max_queue_per_instance
            assert state.inflight == len(mine), state
            assert state.long_prefilling >= 0, state
            assert state.long_prefilling == sum(1 for h in mine if h[2]), state
        total = sum(s.inflight for s in self.sched.states)
        assert total == self.sched.inflight == len(self.held)
        if limits.global_limit is not None:
            assert self.sched.inflight <= limits.global_limit
        for tid, (name, _, _) in self.held.items():
            assert self.sched.holder(tid) == name
        assert len(self.retries) <= limits.gateway_queue_size
        assert {t.id for t in self.sched.queued_tickets() if t.exclude} == set(self.retries)
        for lane, queue in self.queued.items():
            retries = sum(1 for t in self.retries.values() if t.lane is lane)
            assert self.sched.queue_length(lane) == len(queue) + retries
            assert len(queue) <= limits.gateway_queue_size
            actual = [t.id for t in self.sched.queued_tickets() if t.lane is lane and not t.exclude]
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
        assert self.sched.inflight == 0
        assert all(s.long_prefilling == 0 for s in self.sched.states)


@settings(max_examples=200, deadline=None)
@given(setup=setups(), operations=operation_lists)
def test_scheduler_invariants_hold_for_any_operation_sequence(
    setup: Setup, operations: list[Op]
) -> None:
    """Under any operations the scheduler keeps its limits, lanes, FIFO order and bookkeeping."""
    harness = Harness(setup)
    for op in operations:
        harness.step(op)
    harness.finish()
