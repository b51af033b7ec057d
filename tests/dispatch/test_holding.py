"""A held request takes its instance's counters and gives back exactly what it took."""

from __future__ import annotations

import pytest

from gateway.dispatch import InstanceSpec, InstanceState, Lane, Ticket
from gateway.dispatch.holding import Held, counts_toward_running_bound


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


@pytest.mark.parametrize(
    ("bound", "stall", "max_tokens", "counts"),
    [
        (4, 0.3, 32, True),  # 4 x 9.4 ms = 37.5 ms, over half of 50 ms
        (4, 0.3, 128, False),  # 4 x 2.3 ms = 9.4 ms: it absorbs them
        (4, 0.3, 64, False),  # 18.75 ms: under half
        (4, 0.75, 64, True),  # a slow card: 4 x 11.7 ms over 64 tokens
        (1, 0.3, 8, True),
        (4, None, 128, True),  # the card's prefill rate is not known yet
        (4, 0.3, 0, True),  # max_tokens not given
    ],
)
def test_which_long_answers_the_running_bound_counts(
    bound: int, stall: float | None, max_tokens: int, counts: bool
) -> None:
    assert counts_toward_running_bound(bound, stall, max_tokens, 0.05) is counts
