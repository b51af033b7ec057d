"""Spill before refusing: with the split on, a request that admission would refuse for
its predicted wait takes a place of the other lane's instead, if one has room."""

from __future__ import annotations

import random

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    Queued,
    Rejected,
    Scheduler,
    SharedView,
    Ticket,
)

FAR = 1e9
FAST = 20_000.0  # learned prefill tokens/s of a speed-1 card
NOW = 20.0


def split_scheduler(lane_split: bool = True, max_long: int = 1) -> Scheduler:
    """Two fast cards and a slow one, two slots each, the issue's mix recorded until the
    split rests (the fast ones long, the slow one short); the long lane drains 1.5
    requests a second, so the first long request to wait is admitted (0.67 s) and the
    second refused (1.33 s, past the 1 s budget)."""
    limits = Limits(
        max_long_per_instance=max_long,
        max_queue_per_instance=0,
        max_queue_wait_long=1.0,
        lane_split=lane_split,
    )
    specs = [InstanceSpec(f"i{k}", slots=2) for k in range(3)]
    sched = Scheduler(specs, STRATEGIES["least_busy"](limits.metrics_stale_after), limits)
    rng = random.Random(0)
    for state, speed in zip(sched.states, (1.0, 1.0, 0.4), strict=True):
        sched.probe(state.name, True, 0.0, rng)
        state.speed.prefill.update(FAST * speed)
        state.speed.tpot.update(0.001 / speed)
    for t in range(12):
        for _ in range(7):
            sched.lanes.record(Lane.SHORT, 200, 32, float(t))
            sched.lanes.record(Lane.LONG, 6000, 32, float(t))
        sched.update_lanes(t + 0.5, rng)
    sched.apply_shared(SharedView(rates={(Lane.LONG, None): 1.5}), NOW, rng)
    return sched


def long_ticket(i: int) -> Ticket:
    return Ticket(i, Lane.LONG, FAR, tokens=6000, max_tokens=32)


def test_a_long_request_refused_for_its_wait_takes_the_short_cards_place() -> None:
    """The long cards full and one long request already waiting, the next is not refused:
    it prefills on the short-held card, under max_long_per_instance; the one after that,
    with no place left anywhere, is refused."""
    rng = random.Random(0)
    sched = split_scheduler()
    assert [sched.lanes.lane(s) for s in sched.states] == ["long", "long", "short"]
    placed = [sched.submit(long_ticket(i), NOW, rng) for i in (1, 2)]
    assert sorted(d.instance for d in placed if isinstance(d, Assigned)) == ["i0", "i1"]
    assert isinstance(sched.submit(long_ticket(3), NOW, rng), Queued)
    spilled = sched.submit(long_ticket(4), NOW, rng)
    assert spilled == Assigned(long_ticket(4), "i2")
    assert sched.state("i2").long_prefilling == 1
    refused = sched.submit(long_ticket(5), NOW, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "predicted_wait"


def test_without_the_split_a_request_over_its_budget_is_refused() -> None:
    """With the split off there is no other lane to lend a place: shared instances at the
    long cap, the request over its budget is refused as before."""
    rng = random.Random(0)
    sched = split_scheduler(lane_split=False)
    placed = [sched.submit(long_ticket(i), NOW, rng) for i in (1, 2, 3)]
    assert all(isinstance(d, Assigned) for d in placed)
    assert isinstance(sched.submit(long_ticket(4), NOW, rng), Queued)
    refused = sched.submit(long_ticket(5), NOW, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "predicted_wait"


def test_an_admitted_request_waits_for_its_own_lane() -> None:
    """A long request whose wait fits its budget queues for the long lane's first place
    rather than take the short card's: the spill is for overload only."""
    rng = random.Random(0)
    sched = split_scheduler()
    for i in (1, 2):
        sched.submit(long_ticket(i), NOW, rng)
    waiting = sched.submit(long_ticket(3), NOW, rng)
    assert isinstance(waiting, Queued)
    assert sched.state("i2").long_prefilling == 0


def test_a_queued_request_whose_wait_ran_out_takes_the_short_cards_place() -> None:
    """Before the drain rate is known nothing is refused at arrival: a long request queues
    for the long lane, and when its wait runs out it is lent the short-held card's place
    rather than refused (the split's first seconds, when the long lane is still small)."""
    rng = random.Random(0)
    sched = split_scheduler()
    sched.apply_shared(SharedView(), NOW, rng)  # no drain rate known
    for i in (1, 2):
        sched.submit(long_ticket(i), NOW, rng)
    waiting = sched.submit(long_ticket(3), NOW, rng)
    assert isinstance(waiting, Queued)
    assert sched.expire(3, waiting.wait_until, rng) == [Assigned(long_ticket(3), "i2")]


def test_with_no_place_anywhere_a_wait_that_ran_out_is_refused() -> None:
    """With the short-held card at its long cap too, the expired request is refused."""
    rng = random.Random(0)
    sched = split_scheduler()
    sched.apply_shared(SharedView(), NOW, rng)
    for i in (1, 2):
        sched.submit(long_ticket(i), NOW, rng)
    # A retry that tried both long cards takes the short card's one long place.
    retry = Ticket(3, Lane.LONG, FAR, frozenset({"i0", "i1"}), tokens=6000, max_tokens=32)
    assert sched.submit(retry, NOW, rng) == Assigned(retry, "i2")
    waiting = sched.submit(long_ticket(4), NOW, rng)
    assert isinstance(waiting, Queued)
    expired = sched.expire(4, waiting.wait_until, rng)
    assert expired == [Rejected(long_ticket(4), "deadline", sched.limits.queue_retry_after)]
