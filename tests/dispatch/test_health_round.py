"""A health round (`Scheduler.place_waiting`) places what waits where room came back without a
call that says so: an ejection that ran out."""

from __future__ import annotations

import random

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    HealthPolicy,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    Queued,
    Scheduler,
    Ticket,
)


def test_a_queued_request_goes_to_an_instance_whose_ejection_ran_out() -> None:
    """i0 is ejected for 1 s after a failure and i1 is full, so a request waits; once the
    ejection is over, the next health round places it on i0."""
    limits = Limits(max_queue_per_instance=0)
    policy = HealthPolicy(eject_after_failures=1, ejection_base=1.0, max_ejected_fraction=1.0)
    specs = [InstanceSpec("i0", slots=1), InstanceSpec("i1", slots=1)]
    sched = Scheduler(specs, STRATEGIES["least_busy"](30.0, None), limits, policy)
    rng = random.Random(0)
    for state in sched.instances.states:
        sched.probe(state.name, True, 0.0, rng)
    first = sched.submit(Ticket(1, Lane.SHORT, 1e9, frozenset({"i1"})), 0.0, rng)
    assert first == Assigned(first.ticket, "i0")
    sched.release(1, Outcome.FAILURE, 0.0, rng)
    assert not sched.state("i0").available(0.0)  # ejected
    assert isinstance(sched.submit(Ticket(2, Lane.SHORT, 1e9), 0.0, rng), Assigned)  # i1
    waiting = sched.submit(Ticket(3, Lane.SHORT, 1e9), 0.0, rng)
    assert isinstance(waiting, Queued)
    assert sched.place_waiting(0.5, rng) == []  # still ejected: it waits
    assert sched.place_waiting(1.5, rng) == [Assigned(waiting.ticket, "i0")]
