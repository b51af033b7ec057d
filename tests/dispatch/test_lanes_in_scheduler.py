"""The dynamic split between the lanes (lanes.py) inside the scheduler: where requests go
once the split has come to rest, spilling, caps, and a reload."""

from __future__ import annotations

import random

from _lanes_helpers import FAST

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    Queued,
    Scheduler,
    Ticket,
)

FAR = 1e9


# ------------------------------------------------------------------ in the scheduler


def scheduler(*speeds: float, limits: Limits | None = None) -> Scheduler:
    limits = limits or Limits(max_long_per_instance=1, max_queue_per_instance=0)
    specs = [InstanceSpec(f"i{k}", slots=2) for k in range(len(speeds))]
    sched = Scheduler(specs, STRATEGIES["least_busy"](limits.metrics_stale_after), limits)
    rng = random.Random(0)
    for state, speed in zip(sched.states, speeds, strict=True):
        sched.probe(state.name, True, 0.0, rng)
        state.speed.prefill.update(FAST * speed)
        # Decode is cheap here (two slots would otherwise make each output token dear).
        state.speed.tpot.update(0.001 / speed)
    return sched


def ticket(i: int, lane: Lane) -> Ticket:
    tokens = 6000 if lane is Lane.LONG else 200
    return Ticket(i, lane, FAR, tokens=tokens, max_tokens=32)


def settle_split(sched: Scheduler, rng: random.Random) -> None:
    """Record the issue's mix and let the split come to rest."""
    for t in range(12):
        for _ in range(7):
            sched.lanes.record(Lane.SHORT, 200, 32, float(t))
            sched.lanes.record(Lane.LONG, 6000, 32, float(t))
        sched.update_lanes(t + 0.5, rng)


def test_requests_prefer_their_own_lane_and_spill_only_when_it_is_full() -> None:
    """Short requests go to the short-held card until it is full, then spill to long-held
    ones; long requests go to long-held cards up to max_long_per_instance each, and the
    rest wait in the gateway queue for the first place there, not on the short card."""
    rng = random.Random(0)
    sched = scheduler(1, 1, 0.4)
    settle_split(sched, rng)
    assert [sched.lanes.lane(s) for s in sched.states] == ["long", "long", "short"]
    now = 20.0
    longs = [sched.submit(ticket(i, Lane.LONG), now, rng) for i in range(1, 5)]
    assert sorted(d.instance for d in longs if isinstance(d, Assigned)) == ["i0", "i1"]
    assert all(isinstance(d, Queued) for d in longs[2:])
    assert {sched.state("i0").long_prefilling, sched.state("i1").long_prefilling} == {1}
    assert sched.state("i2").long_prefilling == 0
    # Short requests: the short card's two slots first.
    shorts = [sched.submit(ticket(i, Lane.SHORT), now, rng) for i in range(5, 8)]
    assert [d.instance for d in shorts[:2] if isinstance(d, Assigned)] == ["i2", "i2"]
    # Then the long cards' free slot (their long prefill places are taken, not their slots).
    assert assigned_to(shorts[2]) in {"i0", "i1"}


def test_a_queued_long_request_takes_the_first_long_place_that_frees() -> None:
    """With every long-held card at its cap, a long request waits at the gateway and goes
    to whichever long card finishes a prefill first, not to the card it would have
    picked on arrival."""
    rng = random.Random(0)
    sched = scheduler(1, 1, 0.4)
    settle_split(sched, rng)
    now = 20.0
    first = [sched.submit(ticket(i, Lane.LONG), now, rng) for i in (1, 2)]
    waiting = sched.submit(ticket(3, Lane.LONG), now, rng)
    assert isinstance(waiting, Queued)
    done = next(d for d in first if isinstance(d, Assigned) and d.instance == "i1")
    decisions = sched.prefill_done(done.ticket.id, now + 0.5, rng)
    assert [(d.ticket.id, assigned_to(d)) for d in decisions] == [(3, "i1")]


def test_a_short_request_spills_to_a_long_held_card_when_its_own_is_full() -> None:
    """With the short card full, a short request takes a long-held card with room."""
    rng = random.Random(0)
    sched = scheduler(1, 1, 0.4)
    settle_split(sched, rng)
    now = 20.0
    for i in (1, 2):
        assert assigned_to(sched.submit(ticket(i, Lane.SHORT), now, rng)) == "i2"
    assert assigned_to(sched.submit(ticket(3, Lane.SHORT), now, rng)) in {"i0", "i1"}


def test_a_request_spills_to_a_free_slot_rather_than_queue_at_its_own_lane() -> None:
    """With the short card's slots taken, a short request runs at once on a long-held card
    with a free slot rather than queue at the short card; with no free slot anywhere it
    queues at its own lane's card."""
    rng = random.Random(0)
    sched = scheduler(1, 1, 0.4, limits=Limits(max_long_per_instance=2, max_queue_per_instance=4))
    settle_split(sched, rng)
    now = 20.0
    assert [assigned_to(sched.submit(ticket(i, Lane.SHORT), now, rng)) for i in (1, 2)] == [
        "i2",
        "i2",
    ]
    assert assigned_to(sched.submit(ticket(3, Lane.SHORT), now, rng)) in {"i0", "i1"}
    for i in (4, 5, 6):  # the long cards' remaining slots
        assert assigned_to(sched.submit(ticket(i, Lane.LONG), now, rng)) in {"i0", "i1"}
    assert assigned_to(sched.submit(ticket(7, Lane.SHORT), now, rng)) == "i2"


def test_a_long_request_spills_only_when_no_long_held_card_is_up() -> None:
    """A long request waits for its own lane rather than prefill on the short-held card
    (it would stall every short sequence there); with every long-held card down it
    spills, under max_long_per_instance."""
    rng = random.Random(0)
    sched = scheduler(1, 1, 0.4, limits=Limits(max_long_per_instance=1, max_queue_per_instance=2))
    settle_split(sched, rng)
    now = 20.0
    for i in (1, 2):
        assert assigned_to(sched.submit(ticket(i, Lane.LONG), now, rng)) in {"i0", "i1"}
    assert isinstance(sched.submit(ticket(3, Lane.LONG), now, rng), Queued)
    decisions = []
    for name in ("i0", "i1"):
        while sched.state(name).up:
            decisions += sched.probe(name, False, now, rng)
    assert [(d.ticket.id, assigned_to(d)) for d in decisions] == [(3, "i2")]


def test_a_long_request_spilling_to_a_short_held_card_is_capped() -> None:
    """Spilling onto the short-held card, long requests still respect max_long_per_instance."""
    rng = random.Random(0)
    sched = scheduler(1, 0.4, limits=Limits(max_long_per_instance=1, max_queue_per_instance=0))
    settle_split(sched, rng)
    assert [sched.lanes.lane(s) for s in sched.states] == ["long", "short"]
    now = 20.0
    while sched.state("i0").up:
        sched.probe("i0", False, now, rng)
    assert assigned_to(sched.submit(ticket(1, Lane.LONG), now, rng)) == "i1"
    assert isinstance(sched.submit(ticket(2, Lane.LONG), now, rng), Queued)
    assert sched.state("i1").long_prefilling == 1


def test_a_move_to_long_keeps_the_cap_and_the_queue() -> None:
    """A card the split moves to long stays bounded by max_long_per_instance: the long
    request waiting at the gateway starts when a long prefill there finishes, not when
    the card changes lane."""
    rng = random.Random(0)
    sched = scheduler(1, 1, limits=Limits(max_long_per_instance=1))
    first = [sched.submit(ticket(i, Lane.LONG), 0.0, rng) for i in (1, 2)]
    assert sorted(assigned_to(d) for d in first) == ["i0", "i1"]
    assert isinstance(sched.submit(ticket(3, Lane.LONG), 0.0, rng), Queued)
    moved: dict[str, Lane] = {}
    for t in range(1, 6):
        sched.lanes.record(Lane.LONG, 6000, 32, float(t))
        sched.lanes.record(Lane.SHORT, 200, 32, float(t))
        moves, out = sched.update_lanes(t + 0.5, rng)
        assert out == []
        moved.update(moves)
    assert Lane.LONG in moved.values()
    to_long = next(name for name, lane in moved.items() if lane is Lane.LONG)
    done = next(d for d in first if isinstance(d, Assigned) and d.instance == to_long)
    decisions = sched.prefill_done(done.ticket.id, 7.0, rng)
    assert [(d.ticket.id, assigned_to(d)) for d in decisions] == [(3, to_long)]


def assigned_to(decision: object) -> str:
    assert isinstance(decision, Assigned), decision
    return decision.instance


def test_a_reload_keeps_the_split_of_the_instances_that_stay() -> None:
    """On reconfigure, shared instances that stay keep their lane, a new one starts short,
    one made static serves its static lane, and a removed one is forgotten."""
    rng = random.Random(0)
    sched = scheduler(1, 1, 0.4)
    settle_split(sched, rng)
    assert [sched.lanes.lane(s) for s in sched.states] == ["long", "long", "short"]
    specs = [
        InstanceSpec("i0", slots=2),
        InstanceSpec("i2", lane="long", slots=2),
        InstanceSpec("i3", slots=2),
    ]
    sched.reconfigure(specs, sched.limits, sched.health_policy, 30.0, rng)
    assert {s.name: sched.lanes.lane(s) for s in sched.states} == {
        "i0": "long",
        "i2": "long",
        "i3": "short",
    }
    assert sched.lanes.held() == {"i0": Lane.LONG, "i3": Lane.SHORT}
