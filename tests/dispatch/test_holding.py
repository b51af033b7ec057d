"""A held request takes its instance's counters and gives back exactly what it took."""

from __future__ import annotations

import pytest

from gateway.dispatch import InstanceSpec, InstanceState, Lane, Ticket
from gateway.dispatch.holding import Held
from gateway.dispatch.ticket_state import IllegalMove, TicketState


def _counters(state: InstanceState) -> tuple[int, int, int, int, int]:
    return (
        state.inflight,
        state.assigned_total,
        state.pending_prefill_tokens,
        state.long_prefilling,
        state.long_running,
    )


@pytest.mark.parametrize("long_place", [False, True])
def test_take_then_end_prefill_then_leave_gives_everything_back(long_place: bool) -> None:
    """Placed, first token, left: each step gives back its part, and the ticket's state
    follows (prefilling, decoding, released)."""
    state = InstanceState(InstanceSpec("a", slots=4), up=True)
    ticket = Ticket(id=1, lane=Lane.LONG, deadline=60.0, tokens=6000)
    held = Held(state, ticket, uncached=5000, long_place=long_place)
    held.take()
    assert _counters(state) == (1, 1, 5000, int(long_place), int(long_place))
    held.end_prefill()
    assert not held.prefilling
    assert held.ticket_state is TicketState.DECODING
    assert _counters(state) == (1, 1, 0, 0, int(long_place))
    held.leave()
    assert _counters(state) == (0, 1, 0, 0, 0)  # assigned_total counts every placement


@pytest.mark.parametrize("long_place", [False, True])
def test_leaving_with_no_first_token_gives_the_prefill_back_too(long_place: bool) -> None:
    """A request that leaves before its first token (failed, cancelled, taken back) gives
    back its prefill work and long place with the rest: nothing stays counted."""
    state = InstanceState(InstanceSpec("a", slots=4), up=True)
    ticket = Ticket(id=1, lane=Lane.LONG, deadline=60.0, tokens=6000)
    held = Held(state, ticket, uncached=5000, long_place=long_place)
    held.take()
    held.leave()
    assert held.ticket_state is TicketState.RELEASED
    assert _counters(state) == (0, 1, 0, 0, 0)


def test_a_prefill_ended_after_leaving_or_twice_is_refused_and_counts_nothing() -> None:
    """The state table refuses a second end of the prefill and anything after leaving,
    before a counter moves."""
    state = InstanceState(InstanceSpec("a", slots=4), up=True)
    held = Held(state, Ticket(id=7, lane=Lane.SHORT, deadline=60.0, tokens=200), uncached=200)
    held.take()
    held.end_prefill()
    with pytest.raises(IllegalMove, match="ticket 7 cannot go from decoding to decoding"):
        held.end_prefill()
    held.leave()
    for again in (held.end_prefill, held.leave):
        with pytest.raises(IllegalMove, match="from released"):
            again()
    assert _counters(state) == (0, 1, 0, 0, 0)


def test_a_long_request_departs_at_its_prefill_only_on_a_shared_instance() -> None:
    shared = InstanceState(InstanceSpec("a", slots=4), up=True)
    own_lane = InstanceState(InstanceSpec("b", slots=4, lane="long"), up=True)
    long = Ticket(id=1, lane=Lane.LONG, deadline=60.0, tokens=6000)
    short = Ticket(id=2, lane=Lane.SHORT, deadline=60.0, tokens=200)
    assert Held(shared, long).departs_at_prefill
    assert not Held(own_lane, long).departs_at_prefill
    assert not Held(shared, short).departs_at_prefill
