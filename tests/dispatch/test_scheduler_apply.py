"""`Scheduler.apply`: a reloaded instance list and limits, without losing state."""

from __future__ import annotations

import random

from _sched_helpers import FAR, assigned_to, bring_up, holder, inflight_of, make, tk
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch import (
    Assigned,
    HealthPolicy,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    Queued,
    Rejected,
    Ticket,
)


def test_staying_instances_keep_their_state() -> None:
    """An instance kept by a reload keeps health, in-flight count, speed and prefix index."""
    rng = random.Random(1)
    sched = make("a", "b")
    bring_up(sched, rng)
    a = sched.state("a")
    assigned = [assigned_to(sched.submit(tk(i), 0.0, rng)) for i in range(4)]
    a.speed.observe_tpot(0.05)
    a.cache.insert((1, 2, 3))
    before = (a.up, a.inflight, a.speed.tpot.value, len(a.cache))
    sched.apply(
        [InstanceSpec("a", weight=3.0, slots=8), InstanceSpec("c")],
        Limits(),
        HealthPolicy(),
        1.0,
        rng,
    )
    assert sched.state("a") is a
    assert (a.up, a.inflight, a.speed.tpot.value, len(a.cache)) == before
    assert a.spec.weight == 3.0
    assert a.spec.slots == 8
    assert a.inflight == assigned.count("a")
    assert [s.name for s in sched.instances.states] == ["a", "c"]


def test_added_instance_is_unknown_until_probed_then_takes_traffic() -> None:
    """A new instance takes nothing until its first good probe, then it takes requests."""
    rng = random.Random(2)
    sched = make("a", limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    sched.apply(
        [InstanceSpec("a", slots=1), InstanceSpec("b", slots=1)], Limits(0), HealthPolicy(), 0, rng
    )
    assert sched.state("b").up is None
    assert assigned_to(sched.submit(tk(1), 0.0, rng)) == "a"
    assert isinstance(sched.submit(tk(2), 0.0, rng), Queued)
    woken = sched.probe("b", True, 0.0, rng)
    assert [assigned_to(d) for d in woken] == ["b"]


def test_removed_instance_takes_nothing_new_and_its_requests_release() -> None:
    """A removed instance gets no new request; a ticket it held releases without error."""
    rng = random.Random(3)
    sched = make("a", "b")
    bring_up(sched, rng)
    on_b = next(i for i in range(10) if assigned_to(sched.submit(tk(i), 0.0, rng)) == "b")
    sched.apply([InstanceSpec("a")], Limits(), HealthPolicy(), 0.0, rng)
    assert not sched.has("b")
    assert {assigned_to(sched.submit(tk(100 + i), 0.0, rng)) for i in range(20)} == {"a"}
    assert holder(sched, on_b) == "b"
    inflight = inflight_of(sched)
    assert sched.release(on_b, Outcome.FAILURE, 1.0, rng) == []
    assert inflight_of(sched) == inflight - 1
    # Late news about it (a probe or a scrape that was out) is ignored.
    assert sched.probe("b", False, 1.0, rng) == []
    sched.observe_tpot("b", 0.1)


def test_removing_every_instance_of_a_model_rejects_its_queued_requests() -> None:
    """Requests queued for a model no remaining instance serves are turned away at once."""
    rng = random.Random(4)
    limits = Limits(max_queue_per_instance=0)
    other = InstanceSpec("b", models=frozenset({"other"}))
    sched = make(InstanceSpec("a", slots=1, models=frozenset({"m"})), other, limits=limits)
    bring_up(sched, rng)
    sched.submit(Ticket(1, Lane.SHORT, FAR, model="m"), 0.0, rng)
    queued = sched.submit(Ticket(2, Lane.SHORT, FAR, model="m"), 0.0, rng)
    assert isinstance(queued, Queued)
    out = sched.apply([other], limits, HealthPolicy(), 0.0, rng)
    assert [(type(d), d.ticket.id) for d in out] == [(Rejected, 2)]


def test_more_slots_wake_queued_requests() -> None:
    """Raising an instance's slots by reload places requests that waited for room."""
    rng = random.Random(5)
    limits = Limits(max_queue_per_instance=0)
    sched = make(InstanceSpec("a", slots=1), limits=limits)
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    assert isinstance(sched.submit(tk(2), 0.0, rng), Queued)
    out = sched.apply([InstanceSpec("a", slots=2)], limits, HealthPolicy(), 0.0, rng)
    assert [(type(d), d.ticket.id) for d in out] == [(Assigned, 2)]


names = st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True)


@settings(max_examples=150, deadline=None)
@given(first=names, reloads=st.lists(names, min_size=1, max_size=4), seed=st.integers(0, 99))
def test_counts_stay_exact_across_any_sequence_of_reloads(
    first: list[str], reloads: list[list[str]], seed: int
) -> None:
    """Whatever reloads come between assignments, every ticket releases and counts end at 0."""
    rng = random.Random(seed)
    sched = make(*first)
    bring_up(sched, rng)
    held: list[int] = []
    states = {s.name: s for s in sched.instances.states}
    ticket = 0
    for names_now in reloads:
        for _ in range(3):
            ticket += 1
            decision = sched.submit(tk(ticket), 0.0, rng)
            if isinstance(decision, Assigned):
                held.append(ticket)
        sched.apply([InstanceSpec(n) for n in names_now], Limits(), HealthPolicy(), 0, rng)
        states.update({s.name: s for s in sched.instances.states})
        bring_up(sched, rng)
        assert [s.name for s in sched.instances.states] == names_now
        if held:
            sched.release(held.pop(0), Outcome.SUCCESS, 0.0, rng)
    for t in held:
        sched.release(t, Outcome.SUCCESS, 0.0, rng)
    assert inflight_of(sched) == 0
    assert all(s.inflight == 0 and s.pending_prefill_tokens == 0 for s in states.values())


def test_an_instance_removed_and_added_back_keeps_its_in_flight_count() -> None:
    """An instance removed while holding a request and added back before it ends counts it still."""
    rng = random.Random(6)
    sched = make("a", "b")
    bring_up(sched, rng)
    on_b = next(i for i in range(10) if assigned_to(sched.submit(tk(i), 0.0, rng)) == "b")
    b = sched.state("b")
    sched.apply([InstanceSpec("a")], Limits(), HealthPolicy(), 0.0, rng)
    sched.apply([InstanceSpec("a"), InstanceSpec("b")], Limits(), HealthPolicy(), 0.0, rng)
    assert sched.state("b") is b
    assert b.inflight == 1
    sched.release(on_b, Outcome.SUCCESS, 0.0, rng)
    assert b.inflight == 0
