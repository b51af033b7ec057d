"""The ticket state table (ticket_state.py) and the scheduler's moves by it: plain calls."""

from __future__ import annotations

import itertools
import random

import pytest
from _sched_helpers import bring_up, inflight_of, make, queue_length_of, ticket_state, tk

from gateway.dispatch import Assigned, InstanceSpec, Lane, Limits, Outcome, Queued, Rejected
from gateway.dispatch.ticket_state import MOVES, IllegalMove, TicketState, move

S = TicketState
FINAL = {S.RELEASED, S.REJECTED, S.CANCELLED}


def _reachable(start: TicketState) -> set[TicketState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in MOVES[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_table_has_every_state_and_every_life_ends() -> None:
    """Every state has its row; from new each is reachable; the final three lead nowhere
    and every other leads to one of them."""
    assert set(MOVES) == set(TicketState)
    assert _reachable(S.NEW) == set(TicketState)
    assert {s for s, to in MOVES.items() if not to} == FINAL
    assert all(_reachable(s) & FINAL for s in TicketState)
    assert all(S.NEW not in to for to in MOVES.values())  # nothing goes back to new


@pytest.mark.parametrize(("current", "to"), list(itertools.product(TicketState, TicketState)))
def test_move_allows_exactly_the_tables_moves(current: TicketState, to: TicketState) -> None:
    """`move` returns the new state for a move in the table, and raises for any other,
    quoting the ticket, both states and where it may go instead."""
    if to in MOVES[current]:
        assert move(3, current, to) is to
        return
    with pytest.raises(IllegalMove, match=f"ticket 3 cannot go from {current.value} to {to.value}"):
        move(3, current, to)


def test_a_final_state_says_it_is_final() -> None:
    """The error for a move out of a final state says there is nowhere to go."""
    with pytest.raises(IllegalMove, match=r"nowhere \(it is final\)"):
        move(1, S.RELEASED, S.DECODING)


def test_a_ticket_goes_queued_prefilling_decoding_then_is_forgotten() -> None:
    """The scheduler's record of a ticket follows the table: queued, placed (prefilling),
    first token (decoding), released (forgotten: new again to the scheduler)."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    assert isinstance(sched.submit(tk(1), 0.0, rng), Assigned)
    assert isinstance(sched.submit(tk(2), 0.0, rng), Queued)
    assert (ticket_state(sched, 1), ticket_state(sched, 2)) == (S.PREFILLING, S.QUEUED)
    sched.prefill_done(1, 0.1, rng)
    assert ticket_state(sched, 1) is S.DECODING
    assert sched.release(1, Outcome.SUCCESS, 0.2, rng) == [Assigned(tk(2), "a")]
    assert (ticket_state(sched, 1), ticket_state(sched, 2)) == (S.NEW, S.PREFILLING)
    sched.release(2, Outcome.FAILURE, 0.3, rng)  # no first token: straight to released
    assert ticket_state(sched, 2) is S.NEW


@pytest.mark.parametrize("queued", [False, True])
def test_a_live_ticket_submitted_again_is_refused_and_changes_nothing(queued: bool) -> None:
    """A ticket the scheduler holds or queues cannot be submitted again (whatever the
    second submit would decide: here the queue is full): it raises, and the first stays."""
    rng = random.Random(0)
    limits = Limits(max_queue_per_instance=0, gateway_queue_size=1)
    sched = make(InstanceSpec("a", slots=1), limits=limits)
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    live = 2 if queued else 1
    if queued:
        assert isinstance(sched.submit(tk(2), 0.0, rng), Queued)
    before = (inflight_of(sched), queue_length_of(sched, Lane.SHORT), ticket_state(sched, live))
    with pytest.raises(IllegalMove, match=f"ticket {live} is {before[2].value}"):
        sched.submit(tk(live), 0.0, rng)
    assert (
        inflight_of(sched),
        queue_length_of(sched, Lane.SHORT),
        ticket_state(sched, live),
    ) == before


def test_refused_and_cancelled_tickets_leave_the_queue_and_are_forgotten() -> None:
    """A queued ticket refused (its wait ran out, or shutdown) or cancelled is out of the
    queue and new again to the scheduler; a cancel of one not queued is a no."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    for i, deadline in ((2, 5.0), (3, 1e9), (4, 1e9)):
        assert isinstance(sched.submit(tk(i, deadline=deadline), 0.0, rng), Queued)
    assert sched.cancel(3) is True
    assert sched.cancel(3) is False
    assert sched.cancel(1) is False  # held, not queued
    (expired,) = sched.expire(2, 5.0, rng)
    assert isinstance(expired, Rejected)
    assert expired.reason == "deadline"
    (closed,) = sched.close()
    assert isinstance(closed, Rejected)
    assert closed.ticket.id == 4
    assert [ticket_state(sched, i) for i in (1, 2, 3, 4)] == [S.PREFILLING, S.NEW, S.NEW, S.NEW]
    assert queue_length_of(sched, Lane.SHORT) == 0
