"""An instance's running slots learned from its metrics, when it runs fewer than configured."""

from __future__ import annotations

import random

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Queued,
    Scheduler,
    Ticket,
)

FAR = 1e9


def make(slots: int = 256, queue: int = 1) -> Scheduler:
    sched = Scheduler(
        [InstanceSpec("a", slots=slots)],
        STRATEGIES["least_busy"](30.0),
        Limits(max_queue_per_instance=queue),
    )
    sched.probe("a", True, 0.0, random.Random(0))
    return sched


def scrape(sched: Scheduler, at: float, running: float, waiting: float) -> None:
    sched.report_load("a", LoadReport(running, waiting, 0.5, at))


def test_running_flat_while_requests_wait_twice_is_the_instances_capacity() -> None:
    """One running and many waiting, twice in a row: it runs one; place by that."""
    sched = make()
    scrape(sched, 1.0, running=1, waiting=99)
    assert sched.state("a").learned_slots is None  # once may be a step's lag
    scrape(sched, 2.0, running=1, waiting=98)
    assert sched.state("a").learned_slots == 1
    assert sched.state("a").slots == 1
    rng = random.Random(0)
    decisions = [sched.submit(Ticket(i, Lane.SHORT, FAR), 2.0, rng) for i in range(3)]
    assert [type(d) for d in decisions] == [Assigned, Assigned, Queued]  # 1 slot + 1 queued


def test_a_prefill_lag_is_not_taken_for_a_limit() -> None:
    """Requests waiting while the running count grows are a step behind, not a ceiling."""
    sched = make()
    scrape(sched, 1.0, running=3, waiting=5)
    scrape(sched, 2.0, running=7, waiting=2)
    assert sched.state("a").learned_slots is None


def test_running_more_with_nothing_waiting_forgets_the_smaller_capacity() -> None:
    """Its KV cache freed up (or it restarted bigger): the configured slots are back."""
    sched = make()
    scrape(sched, 1.0, running=4, waiting=10)
    scrape(sched, 2.0, running=4, waiting=10)
    assert sched.state("a").slots == 4
    scrape(sched, 3.0, running=6, waiting=0)
    assert sched.state("a").learned_slots is None
    assert sched.state("a").slots == 256


def test_a_learned_capacity_never_raises_the_configured_one() -> None:
    """A full instance running exactly its configured slots learns nothing new."""
    sched = make(slots=8)
    scrape(sched, 1.0, running=8, waiting=4)
    scrape(sched, 2.0, running=8, waiting=4)
    assert sched.state("a").learned_slots is None
    assert sched.state("a").slots == 8
