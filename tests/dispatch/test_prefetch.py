"""`long_prefetch`: a long place opens ahead of its holder's predicted first token."""

from __future__ import annotations

import random

import pytest
from _sched_helpers import FAR, bring_up, make

from gateway.dispatch import Assigned, InstanceSpec, Lane, Limits, Outcome, Queued, Ticket
from gateway.dispatch.scheduler import Scheduler


def _long(i: int) -> Ticket:
    return Ticket(i, Lane.LONG, FAR, tokens=6000, max_tokens=32)


def _card(share: float, queue: int = 0, learned: bool = True) -> Scheduler:
    """One shared card, one long place; with `learned`, a prefill rate of 20,000 tokens/s
    taught by a first long request (6,000 tokens, first token after 0.3 s)."""
    rng = random.Random(0)
    limits = Limits(
        max_long_per_instance=1,
        lane_split=False,
        long_prefetch=share,
        long_prefetch_queue=queue,
    )
    sched = make(InstanceSpec("a", slots=16), limits=limits, strategy="least_time")
    bring_up(sched, rng)
    if learned:
        assert isinstance(sched.submit(_long(0), 0.0, rng), Assigned)
        sched.prefill_done(0, 0.3, rng, ttft=0.3)
        sched.release(0, Outcome.SUCCESS, 1.0, rng)
    return sched


def test_the_next_long_request_goes_a_share_of_the_prefill_before_it_ends() -> None:
    """Sent at 10 s, a 6,000-token prefill at 20,000 tokens/s is due at 10.3 s; with a
    share of 0.1 the place opens 30 ms before, and the queued request takes it then."""
    rng = random.Random(0)
    sched = _card(0.1)
    assert isinstance(sched.submit(_long(1), 10.0, rng), Assigned)
    assert isinstance(sched.submit(_long(2), 10.0, rng), Queued)
    assert sched.wake_at(10.0) == pytest.approx(10.27)
    assert sched.drain(10.26, rng) == []
    (early,) = sched.drain(10.27, rng)
    assert isinstance(early, Assigned)
    assert early.ticket.id == 2


def test_one_early_request_per_place() -> None:
    """The request sent early holds a place of its own, due after the one before it:
    a third waits until that one opens in turn, not when the first is late."""
    rng = random.Random(0)
    sched = _card(0.1)
    sched.submit(_long(1), 10.0, rng)
    sched.submit(_long(2), 10.0, rng)
    sched.drain(10.27, rng)
    assert isinstance(sched.submit(_long(3), 10.28, rng), Queued)
    assert sched.drain(10.4, rng) == []  # the first is late: still one place open only
    # The second is due when the first is (10.3) plus its own prefill: at 10.6.
    assert sched.wake_at(10.4) == pytest.approx(10.57)
    (third,) = sched.drain(10.57, rng)
    assert isinstance(third, Assigned)
    assert third.ticket.id == 3


def test_the_early_request_learns_from_what_was_left_ahead_of_it() -> None:
    """What it waited behind is the rest of the prefill before it (30 ms, 600 tokens),
    not that whole prompt: its first token 0.33 s after sending teaches the same rate."""
    rng = random.Random(0)
    sched = _card(0.1)
    sched.submit(_long(1), 10.0, rng)
    sched.submit(_long(2), 10.0, rng)
    sched.drain(10.27, rng)
    sched.prefill_done(1, 10.3, rng, ttft=0.3)
    sched.prefill_done(2, 10.6, rng, ttft=0.33)
    (state,) = sched.states
    assert state.speed.prefill_rate == pytest.approx(20000.0)


def test_without_a_learned_rate_the_place_opens_at_the_first_token() -> None:
    rng = random.Random(0)
    sched = _card(0.1, learned=False)
    sched.submit(_long(1), 10.0, rng)
    assert isinstance(sched.submit(_long(2), 10.0, rng), Queued)
    assert sched.wake_at(10.0) is None
    assert sched.drain(11.0, rng) == []
    (second,) = sched.prefill_done(1, 11.0, rng, ttft=1.0)
    assert isinstance(second, Assigned)


def test_only_while_enough_long_requests_queue() -> None:
    """With `long_prefetch_queue` 2, one long request waiting does not open a place."""
    rng = random.Random(0)
    sched = _card(0.1, queue=2)
    sched.submit(_long(1), 10.0, rng)
    sched.submit(_long(2), 10.0, rng)
    assert sched.wake_at(10.0) is None
    assert sched.drain(10.29, rng) == []
    sched.submit(_long(3), 10.29, rng)
    (early,) = sched.drain(10.29, rng)
    assert isinstance(early, Assigned)
    assert early.ticket.id == 2


def test_off_by_default() -> None:
    rng = random.Random(0)
    sched = _card(0.0)
    sched.submit(_long(1), 10.0, rng)
    sched.submit(_long(2), 10.0, rng)
    assert sched.wake_at(10.0) is None
    assert sched.drain(10.29, rng) == []
