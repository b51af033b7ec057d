"""Admission control: the departure rate, the predicted wait, and the scheduler's use of them."""

from __future__ import annotations

import random

import pytest
from _sched_helpers import ahead_of, predicted_wait_of, queue_length_of
from hypothesis import given
from hypothesis import strategies as st

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    Queued,
    Rejected,
    Scheduler,
    Ticket,
)
from gateway.dispatch.admission import Throughput, predicted_wait, refusal

FAR = 1e9


def make(*specs: InstanceSpec, **limits: float) -> Scheduler:
    """A scheduler with no per-instance queue (so requests queue here), instances up."""
    sched = Scheduler(
        list(specs),
        STRATEGIES["least_busy"](30.0),
        Limits(max_queue_per_instance=0, **limits),  # type: ignore[arg-type]
    )
    for state in sched.instances.states:
        sched.probe(state.name, True, 0.0, random.Random(0))
    return sched


def test_rate_is_unknown_until_three_saturated_gaps() -> None:
    """Fewer than three gaps between saturated departures tell nothing; then it is their mean."""
    t = Throughput(window=30.0)
    assert t.rate(0.0) is None
    for at in (0.0, 0.5, 1.0):
        t.record(at)
    assert t.rate(1.0) is None  # two gaps
    t.record(1.5)
    assert t.rate(1.5) == 3 / 1.5


def test_lulls_between_unsaturated_departures_do_not_lower_the_rate() -> None:
    """A departure that found no queue breaks the chain: the idle time after it is no gap."""
    t = Throughput(window=30.0)
    for at in (0.0, 0.5, 1.0, 1.5):  # saturated: 2 per second
        t.record(at)
    t.record(2.0, saturated=False)  # the queue ran dry: arrivals, not service, set the pace
    for at in (10.0, 10.5, 11.0):  # saturated again after a lull
        t.record(at)
    assert t.rate(11.0) == 2.0


def test_rate_forgets_gaps_older_than_its_window() -> None:
    """Gaps leave the window after `window` seconds, and with too few left it is unknown."""
    t = Throughput(window=5.0)
    for i in range(11):
        t.record(i * 0.1)
    assert t.rate(1.0) == 10 / 1.0
    assert t.rate(5.05) == 9 / 0.9
    assert t.rate(10.0) is None


def test_refusal_admits_within_budget_and_says_when_to_come_back() -> None:
    """Wait = (ahead + 1) / rate; over the budget it comes back after the excess, and not
    before the next departure (1 / rate)."""
    assert predicted_wait(9, 2.0) == 5.0
    assert predicted_wait(9, None) is None
    assert refusal(9, 2.0, budget=5.0) is None
    assert refusal(39, 2.0, budget=10.0) == 10.0
    assert refusal(10, 2.0, budget=5.0) == 0.5  # 0.5 s over
    assert refusal(12, 2.0, budget=5.0) == 1.5  # 1.5 s over
    assert refusal(20, 10.0, budget=2.09) == pytest.approx(0.1)  # 0.01 s over: one departure
    assert refusal(10_000, None, budget=1.0) is None  # unknown rate: the timer bounds it


def test_queued_ticket_carries_when_its_wait_runs_out() -> None:
    """A queued ticket leaves at the earlier of its deadline and now + max_queue_wait."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_wait_short=2.0, max_queue_wait_long=9.0)
    assert isinstance(sched.submit(Ticket(1, Lane.SHORT, FAR), 10.0, rng), Assigned)
    assert sched.submit(Ticket(2, Lane.SHORT, FAR), 10.0, rng) == Queued(
        Ticket(2, Lane.SHORT, FAR), 1, 12.0
    )
    assert sched.submit(Ticket(3, Lane.SHORT, 11.0), 10.0, rng) == Queued(
        Ticket(3, Lane.SHORT, 11.0), 2, 11.0
    )


def test_expire_rejects_only_a_ticket_still_queued_and_due() -> None:
    """expire() is a no-op early or after placement, and a deadline rejection when due."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_wait_short=2.0)
    sched.submit(Ticket(1, Lane.SHORT, FAR), 0.0, rng)
    sched.submit(Ticket(2, Lane.SHORT, FAR), 0.0, rng)
    assert sched.expire(2, 1.999, rng) == []  # the shell's timer ran early
    assert sched.expire(2, 2.0, rng) == [
        Rejected(Ticket(2, Lane.SHORT, FAR), "deadline", sched.limits.queue_retry_after)
    ]
    assert queue_length_of(sched, Lane.SHORT) == 0
    assert sched.expire(2, 3.0, rng) == []  # gone already
    assert sched.expire(1, 3.0, rng) == []  # placed, not queued


def saturate(sched: Scheduler, rng: random.Random, departures: int, every: float) -> float:
    """Keep instance "a" (one slot) full with one request waiting behind it, and let
    `departures` requests finish `every` s apart; at the end the one waiting is placed and
    nothing waits."""
    now = 0.0
    ids = iter(range(1000, 100_000))
    held = next(ids)
    sched.submit(Ticket(held, Lane.SHORT, FAR), now, rng)
    waiting = next(ids)
    sched.submit(Ticket(waiting, Lane.SHORT, FAR), now, rng)
    for step in range(departures):
        now += every
        placed = sched.release(held, Outcome.SUCCESS, now, rng)
        assert [d.ticket.id for d in placed] == [waiting]
        held = waiting
        if step < departures - 1:
            waiting = next(ids)
            assert isinstance(sched.submit(Ticket(waiting, Lane.SHORT, FAR), now, rng), Queued)
    return now


def test_request_predicted_to_wait_past_its_budget_is_refused_at_arrival() -> None:
    """At 2 departures/s and a 2 s budget, 4 may queue; the 5th is refused, told to come
    back after its excess (2.5 s of wait, 0.5 s over)."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_wait_short=2.0)
    now = saturate(sched, rng, departures=6, every=0.5)
    for i in range(1, 4):  # waits of 0.5, 1.0 and 1.5 s
        assert isinstance(sched.submit(Ticket(i, Lane.SHORT, FAR), now, rng), Queued)
    assert isinstance(sched.submit(Ticket(4, Lane.SHORT, FAR), now, rng), Queued)  # 2.0 s
    refused = sched.submit(Ticket(5, Lane.SHORT, FAR), now, rng)
    assert refused == Rejected(Ticket(5, Lane.SHORT, FAR), "predicted_wait", 0.5)
    assert queue_length_of(sched, Lane.SHORT) == 4


def test_short_deadline_is_a_smaller_budget() -> None:
    """What is left of the request's deadline caps its budget below max_queue_wait."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_wait_short=60.0)
    now = saturate(sched, rng, departures=6, every=0.5)
    sched.submit(Ticket(1, Lane.SHORT, FAR), now, rng)  # wait 0.5 s
    refused = sched.submit(Ticket(2, Lane.SHORT, now + 0.8), now, rng)  # would wait 1.0 s
    assert isinstance(refused, Rejected)
    assert refused.reason == "predicted_wait"


def test_long_request_on_a_shared_instance_departs_when_its_prefill_ends() -> None:
    """On a shared instance the long lane drains at first tokens (max_long_per_instance)."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=100), max_long_per_instance=1)  # type: ignore[arg-type]
    now = 0.0
    tickets = [Ticket(i, Lane.LONG, FAR, tokens=8000) for i in range(1, 7)]
    assert isinstance(sched.submit(tickets[0], now, rng), Assigned)
    for ticket in tickets[1:]:
        assert isinstance(sched.submit(ticket, now, rng), Queued)
    for i in range(1, 6):  # each first token lets the next long request in
        now += 0.5
        assert [d.ticket.id for d in sched.prefill_done(i, now, rng)] == [i + 1]
    assert predicted_wait_of(sched, Lane.LONG, now) is not None
    assert predicted_wait_of(sched, Lane.SHORT, now) is None  # nothing left a slot yet


def test_the_lanes_time_to_first_token_comes_off_the_budget() -> None:
    """A request that could start in 1.5 s of a 2 s budget is refused once the lane's
    requests take a second from being sent to their first token."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_wait_short=2.0)
    now = saturate(sched, rng, departures=6, every=0.5)
    sched.submit(Ticket(1, Lane.SHORT, FAR), now, rng)  # waits 0.5 s
    sched.submit(Ticket(2, Lane.SHORT, FAR), now, rng)  # waits 1.0 s
    assert isinstance(sched.submit(Ticket(3, Lane.SHORT, FAR), now, rng), Queued)  # 1.5 s
    for ticket_id in (1, 2, 3):
        sched.cancel(ticket_id)
    held = sched._holding  # the one request "a" runs now: its first token took a second
    (running,) = held
    sched.prefill_done(running, now, rng, ttft=1.0)
    sched.submit(Ticket(4, Lane.SHORT, FAR), now, rng)  # waits 0.5 s: within 2 - 1
    sched.submit(Ticket(5, Lane.SHORT, FAR), now, rng)  # 1.0 s: exactly the budget
    refused = sched.submit(Ticket(6, Lane.SHORT, FAR), now, rng)  # 1.5 s: over
    assert isinstance(refused, Rejected)
    assert refused.reason == "predicted_wait"


@given(
    departures=st.integers(3, 40),
    every=st.floats(0.05, 1.0),
    budget=st.floats(1.5, 30.0),  # above `every`: the one waiting never times out
    arrivals=st.integers(1, 200),
)
def test_admitted_queue_never_exceeds_rate_times_budget(
    departures: int, every: float, budget: float, arrivals: int
) -> None:
    """Whatever the pace and budget, the queue admitted is at most rate x budget (+1)."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_wait_short=budget)
    now = saturate(sched, rng, departures=departures, every=every)
    rate = sched._departures.rate(Lane.SHORT, None, now)
    for i in range(arrivals):
        sched.submit(Ticket(i, Lane.SHORT, FAR), now, rng)
    if rate is not None:
        assert queue_length_of(sched, Lane.SHORT) <= rate * budget + 1


def test_one_models_queue_does_not_get_another_model_refused() -> None:
    """Admission predicts per model: model-a's long queue does not refuse a model-b request."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1, models=frozenset({"model-a"})),
        InstanceSpec("b", slots=1, models=frozenset({"model-b"})),
        max_queue_wait_short=2.0,
    )
    now = 0.0
    sched.submit(Ticket(100, Lane.SHORT, FAR, model="model-b"), now, rng)
    running, waiting = 101, 102
    sched.submit(Ticket(running, Lane.SHORT, FAR, model="model-a"), now, rng)
    sched.submit(Ticket(waiting, Lane.SHORT, FAR, model="model-a"), now, rng)
    for step in range(6):  # model-a's instance finishes one request every 0.5 s, saturated
        now += 0.5
        sched.release(running, Outcome.SUCCESS, now, rng)
        running, waiting = waiting, 103 + step
        sched.submit(Ticket(waiting, Lane.SHORT, FAR, model="model-a"), now, rng)
    sched.cancel(waiting)
    queued = [sched.submit(Ticket(i, Lane.SHORT, FAR, model="model-a"), now, rng) for i in range(4)]
    assert isinstance(queued[-1], Queued)
    refused = sched.submit(Ticket(10, Lane.SHORT, FAR, model="model-a"), now, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "predicted_wait"
    other = sched.submit(Ticket(11, Lane.SHORT, FAR, model="model-b"), now, rng)
    assert isinstance(other, Queued)  # b's rate is unknown: nothing refused by prediction
    assert ahead_of(sched, Lane.SHORT, "model-b") == 1
