"""Invariants of the scheduler under random operation sequences (hypothesis, no event loop).

Each example draws a fleet and limits (_sched_ops.py), then replays a list of operations
against the scheduler while a small independent model (_sched_model.py) tracks which
tickets are held and queued. After every step the scheduler's state is checked against the
invariants and against the model.
"""

from __future__ import annotations

import pytest
from _sched_helpers import predicted_wait_of
from _sched_model import Model
from _sched_ops import (
    Advance,
    Cancel,
    Op,
    PlaceWaiting,
    PrefillDone,
    Probe,
    Release,
    Report,
    Setup,
    Submit,
    operation_lists,
    setups,
)
from hypothesis import given, settings

from gateway.dispatch import Assigned, Lane, LoadReport, Outcome, Queued, Ticket, UnknownTicket


class Harness(Model):
    """The model driven by operations: each applies one to the scheduler and checks what it
    returned."""

    # ---------------------------------------------------------------- operations

    def submit(self, op: Submit) -> None:
        tid = self.next_id
        self.next_id += 1
        exclude = frozenset(
            s.name for k, s in enumerate(self.setup.specs) if op.exclude_mask >> k & 1
        )
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
                wait = predicted_wait_of(self.sched, op.lane, self.now, ticket.model)
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
            states = self.sched.instances.states
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
        self.first_token.add(tid)
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

    def place_waiting(self) -> None:
        self.settle(self.sched.place_waiting(self.now, self.rng), drained=True)

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
        elif isinstance(op, PlaceWaiting):
            self.place_waiting()
        else:
            self.report(op)
        self.check()


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
