"""The operator's drain in the pure scheduler: a drained instance takes no new request, its
own finish, what waits goes elsewhere (or is refused with nowhere left) and a resumed
instance takes the queue."""

from __future__ import annotations

import random

from _sched_helpers import assigned_to, bring_up, make, tk

from gateway.dispatch import Assigned, InstanceSpec, Limits, Outcome, Queued, Rejected

ONE_SLOT = Limits(max_queue_per_instance=0)


def test_a_drained_instance_takes_nothing_new_and_keeps_what_it_holds() -> None:
    rng = random.Random(1)
    sched = make("a", "b")
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    assert sched.set_drained({"a": 1234.0}, 0.0, rng) == []
    assert sched.state("a").inflight == 1  # it finishes what it holds
    assert {assigned_to(sched.submit(tk(i), 0.0, rng)) for i in range(2, 12)} == {"b"}
    sched.release(1, Outcome.SUCCESS, 0.0, rng)
    assert sched.state("a").inflight == 0
    snap = sched.snapshot(0.0).instances[0]
    assert (snap.name, snap.available, snap.drained_since) == ("a", False, 1234.0)
    assert sched.state("a").up is True  # the verdict is the probes', drained or not


def test_what_waits_for_a_drained_instance_goes_elsewhere_or_is_refused() -> None:
    rng = random.Random(2)
    sched = make(InstanceSpec("a", slots=1), InstanceSpec("b", slots=1), limits=ONE_SLOT)
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    assert assigned_to(sched.submit(tk(2, exclude={"a"}), 0.0, rng)) == "b"
    assert isinstance(sched.submit(tk(3), 0.0, rng), Queued)
    sched.set_drained({"b": 1.0}, 0.0, rng)
    # The slot freed on the drained instance places nobody; the one freed on "a" does.
    assert not any(isinstance(d, Assigned) for d in sched.release(2, Outcome.SUCCESS, 0.0, rng))
    decisions = sched.release(1, Outcome.SUCCESS, 0.0, rng)
    assert [(type(d), getattr(d, "instance", None)) for d in decisions] == [(Assigned, "a")]
    # With every instance drained, the waiting request has nowhere to go: refused at once.
    sched = make(InstanceSpec("a", slots=1), limits=ONE_SLOT)
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1), 0.0, rng)) == "a"
    assert isinstance(sched.submit(tk(2), 0.0, rng), Queued)
    refused = sched.set_drained({"a": 1.0}, 0.0, rng)
    assert [type(d) for d in refused] == [Rejected]


def test_a_resumed_instance_takes_the_queue() -> None:
    rng = random.Random(3)
    sched = make(InstanceSpec("a", slots=1), InstanceSpec("b", slots=1), limits=ONE_SLOT)
    bring_up(sched, rng)
    sched.set_drained({"b": 1.0}, 0.0, rng)
    assert assigned_to(sched.submit(tk(1), 0.0, rng)) == "a"
    assert isinstance(sched.submit(tk(2), 0.0, rng), Queued)
    assert sched.set_drained({"b": 1.0}, 0.0, rng) == []  # no change, no decision
    decisions = sched.set_drained({}, 0.0, rng)
    assert [(type(d), getattr(d, "instance", None)) for d in decisions] == [(Assigned, "b")]
