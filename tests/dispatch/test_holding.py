"""A held request takes its instance's counters and gives back exactly what it took."""

from __future__ import annotations

import pytest

from gateway.dispatch import InstanceSpec, InstanceState, Lane, Ticket
from gateway.dispatch.holding import Held


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
    state = InstanceState(InstanceSpec("a", slots=4), up=True)
    ticket = Ticket(id=1, lane=Lane.LONG, deadline=60.0, tokens=6000)
    held = Held(state, ticket, uncached=5000, long_place=long_place)
    held.take()
    assert _counters(state) == (1, 1, 5000, int(long_place), int(long_place))
    held.end_prefill()
    assert not held.prefilling
    assert _counters(state) == (1, 1, 0, 0, int(long_place))
    held.leave()
    assert _counters(state) == (0, 1, 0, 0, 0)  # assigned_total counts every placement


def test_leaving_before_the_prefill_is_ended_is_a_bug() -> None:
    """The scheduler ends the prefill first (it records a departure there): skipping it
    would leave the prefill work and long place counted."""
    state = InstanceState(InstanceSpec("a", slots=4), up=True)
    held = Held(state, Ticket(id=1, lane=Lane.SHORT, deadline=60.0, tokens=200), uncached=200)
    held.take()
    with pytest.raises(AssertionError, match="end_prefill before leave"):
        held.leave()


def test_a_long_request_departs_at_its_prefill_only_on_a_shared_instance() -> None:
    shared = InstanceState(InstanceSpec("a", slots=4), up=True)
    own_lane = InstanceState(InstanceSpec("b", slots=4, lane="long"), up=True)
    long = Ticket(id=1, lane=Lane.LONG, deadline=60.0, tokens=6000)
    short = Ticket(id=2, lane=Lane.SHORT, deadline=60.0, tokens=200)
    assert Held(shared, long).departs_at_prefill
    assert not Held(own_lane, long).departs_at_prefill
    assert not Held(shared, short).departs_at_prefill
