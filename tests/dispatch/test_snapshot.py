"""The scheduler's snapshot: a frozen copy that readers hold while the scheduler moves on."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    HealthPolicy,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    Scheduler,
    Ticket,
)

FAR = 1e9


def _scheduler() -> tuple[Scheduler, random.Random]:
    limits = Limits()
    sched = Scheduler(
        [InstanceSpec("a", slots=1), InstanceSpec("b", lane="long", models=frozenset({"m"}))],
        STRATEGIES["least_busy"](limits.metrics_stale_after),
        limits,
        HealthPolicy(),
    )
    rng = random.Random(1)
    for name in ("a", "b"):
        sched.probe(name, True, 0.0, rng)
    return sched, rng


def test_the_snapshot_says_what_the_live_state_said() -> None:
    """Each instance's figures in the snapshot are those of the live state when it was taken."""
    sched, rng = _scheduler()
    sched.report_load("a", LoadReport(running=3, waiting=2, kv_usage=0.5, at=1.0))
    decision = sched.submit(Ticket(1, Lane.SHORT, FAR), 1.0, rng)
    assert isinstance(decision, Assigned)
    snap = sched.snapshot(1.5)
    a, b = snap.instances
    assert (a.name, a.verdict, a.available, a.inflight) == ("a", "up", True, 1)
    assert a.fresh_report == a.report == sched.state("a").report
    assert a.queue_depth == sched.state("a").queue_depth(sched.state("a").report)
    assert (b.lane, b.pinned_models, b.models) == ("long", frozenset({"m"}), frozenset({"m"}))
    assert snap.inflight == 1
    assert snap.up() == (a, b)
    assert dict(snap.queues) == {Lane.SHORT: 0, Lane.LONG: 0}
    assert snap.strategy == "least_busy"


def test_the_snapshot_is_a_copy_the_scheduler_does_not_change() -> None:
    """After the snapshot, placing, failing and queueing change the scheduler, not the snapshot."""
    sched, rng = _scheduler()
    snap = sched.snapshot(0.0)
    before = dataclasses.astuple(snap.instances[0]), snap.inflight, dict(snap.queues)
    first = sched.submit(Ticket(1, Lane.SHORT, FAR), 1.0, rng)
    assert isinstance(first, Assigned)
    sched.submit(Ticket(2, Lane.SHORT, FAR), 1.0, rng)  # a is full: queued in the gateway
    sched.release(1, Outcome.FAILURE, 2.0, rng, "status 502")
    sched.probe("a", False, 2.0, rng)
    assert (dataclasses.astuple(snap.instances[0]), snap.inflight, dict(snap.queues)) == before
    later = sched.snapshot(2.0)
    assert later.instances[0].recent_errors != snap.instances[0].recent_errors
    assert later.instances[0].failures_total == 1


def test_a_reader_cannot_change_the_scheduler_through_the_snapshot() -> None:
    """The snapshot and its parts are frozen: assigning to them raises."""
    sched, _ = _scheduler()
    snap = sched.snapshot(0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.instances[0].inflight = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.queues[Lane.SHORT] = 5  # type: ignore[index]
    assert isinstance(snap.instances[0].recent_errors, tuple)
    assert sched.state("a").inflight == 0
