"""The dynamic split between the lanes (lanes.py) on its own: examples and properties of
`LaneSplit` over a fleet of cards of known speeds. Inside the scheduler:
test_lanes_in_scheduler.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from _lanes_helpers import FAST
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch import InstanceSpec, InstanceState, Lane
from gateway.dispatch.lanes import (
    BULK_TOKENS,
    CONFIRM,
    WINDOW,
    LaneSplit,
    Mix,
    Move,
    capacities,
    propose,
)
from gateway.dispatch.model import InstanceLane


def fleet(*speeds: float, lanes: Sequence[InstanceLane] = ()) -> list[InstanceState]:
    """Instances i0, i1, ... up, with learned prefill rates FAST x speed."""
    states = []
    for k, speed in enumerate(speeds):
        lane = lanes[k] if k < len(lanes) else "any"
        state = InstanceState(InstanceSpec(f"i{k}", lane=lane, slots=16))
        state.up = True
        state.speed.prefill.update(FAST * speed)
        state.speed.tpot.update(0.013 / speed)
        states.append(state)
    return states


def traffic(split: LaneSplit, now: float, short: int, long: int, out: int = 32) -> None:
    """One second's requests: `short` 200-token and `long` 6,000-token prompts."""
    for _ in range(short):
        split.record(Lane.SHORT, 200, out, now)
    for _ in range(long):
        split.record(Lane.LONG, 6000, out, now)


def run(
    split: LaneSplit, states: list[InstanceState], seconds: int, short: int, long: int, t0: float
) -> list[dict[str, Lane]]:
    """One evaluation a second (a health round) under a steady mix; the moves of each."""
    moves = []
    for k in range(seconds):
        traffic(split, t0 + k, short, long)
        moves.append(split.evaluate(states, t0 + k + 0.5))
    return moves


def lanes_of(split: LaneSplit, states: list[InstanceState]) -> dict[str, str]:
    return {s.name: split.lane(s) for s in states}


def test_before_any_traffic_every_shared_instance_serves_short() -> None:
    """With nothing recorded, the split holds every shared instance for short and moves none."""
    states = fleet(1, 1, 0.4)
    split = LaneSplit(states)
    assert lanes_of(split, states) == {"i0": "short", "i1": "short", "i2": "short"}
    assert [split.evaluate(states, float(t)) for t in range(5)] == [{}] * 5


def test_issue_mix_gives_the_slow_card_to_short_and_the_fast_ones_to_long() -> None:
    """Half 200-token, half 6,000-token prompts on speeds 1,1,1,0.4: long prefill is ~97% of
    the work, so three fast cards serve long and the slow card serves short."""
    states = fleet(1, 1, 1, 0.4)
    split = LaneSplit(states)
    moves = run(split, states, 20, short=7, long=7, t0=0.0)
    assert lanes_of(split, states) == {"i0": "long", "i1": "long", "i2": "long", "i3": "short"}
    made = [m for m in moves if m]
    assert len(made) == 3
    assert all(len(m) == 1 for m in made)
    # Each move waited for the same verdict CONFIRM evaluations in a row.
    assert moves[: CONFIRM - 1] == [{}] * (CONFIRM - 1)


def test_a_short_heavy_mix_keeps_most_instances_short() -> None:
    """Mostly short prompts with long outputs: decode work counts, so short keeps the most."""
    states = fleet(1, 1, 1, 1)
    split = LaneSplit(states)
    for t in range(20):
        for _ in range(20):
            split.record(Lane.SHORT, 600, 128, float(t))
        split.record(Lane.LONG, 6000, 128, float(t))
        split.evaluate(states, t + 0.5)
    assert sorted(lanes_of(split, states).values()) == ["long", "short", "short", "short"]


def _bulk_samples(split: LaneSplit, states: list[InstanceState]) -> None:
    """Each instance's first tokens after 6,000 tokens of prefill, at its true speed."""
    for s in states:
        assert s.speed.prefill.value is not None
        split.observe_prefill(s.name, 6000, 6000 / s.speed.prefill.value)


def test_short_first_tokens_do_not_make_the_short_lane_look_slow() -> None:
    """The slow card, serving short prompts, learns a prefill rate 10x too low (each first
    token waits for a whole engine step); the split sizes by bulk samples and keeps it
    alone in the short lane, where those learned rates would move a fast card to it."""
    for with_bulk in (True, False):
        states = fleet(1, 1, 1, 0.4)
        split = LaneSplit(states)
        _bulk_samples(split, states)
        run(split, states, 20, short=7, long=7, t0=0.0)
        assert lanes_of(split, states)["i3"] == "short"
        states[3].speed.prefill.value = 0.4 * FAST / 10  # what short first tokens teach
        if not with_bulk:
            split._bulk.clear()  # as if sized by InstanceState.speed alone
        run(split, states, 10, short=7, long=7, t0=20.0)
        short = [name for name, lane in lanes_of(split, states).items() if lane == "short"]
        assert (short == ["i3"]) is with_bulk, (with_bulk, short)


def test_an_instance_without_bulk_samples_counts_at_its_relative_speed() -> None:
    """A card never sent a long prompt counts at the median bulk rate scaled by its learned
    speed relative to the cards with bulk samples; with nothing learned, by its weight."""
    states = fleet(1, 1, 1, 0.4)
    bulk = {s.name: 18_000.0 for s in states[:3]}
    assert capacities(states, bulk) == {
        "i0": 18_000.0,
        "i1": 18_000.0,
        "i2": 18_000.0,
        "i3": pytest.approx(18_000.0 * 0.4),
    }
    fresh = [InstanceState(InstanceSpec(n, weight=w)) for n, w in (("a", 1.0), ("b", 3.0))]
    assert capacities(fresh) == {"a": 1.0, "b": 3.0}


def test_small_prefill_samples_teach_the_split_nothing() -> None:
    """Only samples of BULK_TOKENS or more of prefill work count toward the split's rates."""
    split = LaneSplit(fleet(1))
    split.observe_prefill("i0", BULK_TOKENS - 1, 0.001)
    assert split.rates() == {}
    split.observe_prefill("i0", BULK_TOKENS, 0.1)
    assert split.rates() == {"i0": BULK_TOKENS / 0.1}


def test_no_long_traffic_in_the_window_gives_every_instance_back_to_short() -> None:
    """Once long traffic stops for a window, every shared instance returns to short."""
    states = fleet(1, 1, 1, 0.4)
    split = LaneSplit(states)
    run(split, states, 20, short=7, long=7, t0=0.0)
    assert "long" in lanes_of(split, states).values()
    run(split, states, int(WINDOW) + 10, short=7, long=0, t0=20.0)
    assert set(lanes_of(split, states).values()) == {"short"}


def test_no_short_traffic_gives_every_instance_to_long() -> None:
    """A long-only mix takes every shared instance for the long lane, one at a time."""
    states = fleet(1, 1, 0.4)
    split = LaneSplit(states)
    moves = run(split, states, 10, short=0, long=5, t0=0.0)
    assert set(lanes_of(split, states).values()) == {"long"}
    assert all(len(m) <= 1 for m in moves)


def test_a_lane_with_traffic_keeps_its_last_instance() -> None:
    """One shared instance and both lanes busy: it stays short, long requests spill to it."""
    states = fleet(1)
    split = LaneSplit(states)
    assert run(split, states, 10, short=1, long=20, t0=0.0) == [{}] * 10
    assert split.lane(states[0]) == "short"


def test_static_lanes_never_move_and_count_toward_their_lane() -> None:
    """A static long card carries the long work: the shared ones stay short."""
    states = fleet(1, 1, 1, lanes=["long"])
    split = LaneSplit(states)
    run(split, states, 20, short=20, long=1, t0=0.0)
    assert lanes_of(split, states) == {"i0": "long", "i1": "short", "i2": "short"}
    run(split, states, 20, short=0, long=10, t0=20.0)
    assert lanes_of(split, states)["i0"] == "long"


def test_an_instance_that_goes_down_is_replaced_in_its_lane() -> None:
    """When the short lane's only instance goes down, a long-held one moves to short."""
    states = fleet(1, 1, 1, 0.4)
    split = LaneSplit(states)
    run(split, states, 20, short=7, long=7, t0=0.0)
    assert split.lane(states[3]) == "short"
    states[3].up = False
    run(split, states, 4, short=7, long=7, t0=20.0)
    assert sum(split.lane(s) == "short" for s in states[:3]) == 1


def test_a_fast_card_in_the_short_lane_swaps_with_the_slow_one_in_the_long() -> None:
    """No single move improves a split with the slow card in the long lane and a fast one
    in the short (either lane would lose too much), but swapping them does."""
    states = fleet(1, 1, 1, 0.4)
    held = {"i0": Lane.SHORT, "i1": Lane.LONG, "i2": Lane.LONG, "i3": Lane.LONG}
    mix = Mix(
        prompt={Lane.SHORT: 7 * 200, Lane.LONG: 7 * 6000}, output={Lane.SHORT: 224, Lane.LONG: 224}
    )
    assert propose(states, held, mix, 0.0) == Move((("i0", Lane.LONG), ("i3", Lane.SHORT)))
    held.update({"i0": Lane.LONG, "i3": Lane.SHORT})
    assert propose(states, held, mix, 0.0) is None


def test_a_changed_verdict_restarts_the_confirmation() -> None:
    """A proposal must be the same CONFIRM evaluations in a row: an interruption resets it."""
    states = fleet(1, 1)
    split = LaneSplit(states)
    traffic(split, 0.0, short=1, long=5)
    assert split.evaluate(states, 0.5) == {}  # proposes a move to long, once
    states[0].up = states[1].up = False  # nothing can move now: no proposal
    assert split.evaluate(states, 1.0) == {}
    states[0].up = states[1].up = True
    assert split.evaluate(states, 1.5) == {}  # the proposal again, but counted from one
    assert len(split.evaluate(states, 2.0)) == 1


def test_split_off_serves_both_lanes_everywhere() -> None:
    """With lane_split off every shared instance serves both lanes and nothing moves."""
    states = fleet(1, 1, 0.4)
    split = LaneSplit(states, enabled=False)
    assert run(split, states, 10, short=7, long=7, t0=0.0) == [{}] * 10
    assert set(lanes_of(split, states).values()) == {"any"}
    assert all(split.capped(s) for s in states)


# ------------------------------------------------------------------ properties


@st.composite
def fleets(draw: st.DrawFn) -> list[InstanceState]:
    n = draw(st.integers(1, 6))
    speeds = [draw(st.sampled_from([0.25, 0.4, 1.0, 1.0, 2.0])) for _ in range(n)]
    lanes: list[InstanceLane] = [
        draw(st.sampled_from(["any", "any", "short", "long"])) for _ in speeds
    ]
    return fleet(*speeds, lanes=lanes)


mixes = st.tuples(st.integers(0, 30), st.integers(0, 10)).filter(lambda m: m != (0, 0))


@settings(max_examples=200, deadline=None)
@given(fleets(), mixes)
def test_steady_mix_never_flaps(states: list[InstanceState], mix: tuple[int, int]) -> None:
    """On a steady mix the split moves at most one instance (or swaps two) per round,
    never returns to an earlier split, and comes to rest."""
    split = LaneSplit(states)
    seen = [lanes_of(split, states)]
    for t in range(60):
        traffic(split, float(t), *mix)
        moves = split.evaluate(states, t + 0.5)
        assert len(moves) <= 1 or set(moves.values()) == set(Lane)  # one, or a swap
        now = lanes_of(split, states)
        if moves:
            assert now not in seen, f"returned to an earlier split at {t}: {now}"
            seen.append(now)
    # It has come to rest: further rounds of the same mix move nothing.
    assert run(split, states, 10, *mix, t0=60.0) == [{}] * 10


@settings(max_examples=200, deadline=None)
@given(fleets(), st.lists(mixes, min_size=1, max_size=6), st.lists(st.booleans(), max_size=6))
def test_lanes_with_traffic_keep_an_instance_and_static_lanes_never_move(
    states: list[InstanceState], phases: list[tuple[int, int]], down: list[bool]
) -> None:
    """Whatever the mix does, a lane with traffic that has an instance keeps one, and static
    instances serve their own lane."""
    split = LaneSplit(states)
    for k, state in enumerate(states):
        if k < len(down) and down[k] and k > 0:  # never all down
            state.up = False
    t = 0.0
    for short, long in phases:
        for _ in range(8):
            traffic(split, t, short, long)
            before = {
                lane: any(s.available(t) and split.lane(s) == lane.value for s in states)
                for lane in Lane
            }
            split.evaluate(states, t + 0.5)
            for s in states:
                if s.spec.lane != "any":
                    assert split.lane(s) == s.spec.lane
            mix = split.mix(t + 0.5)
            for lane in Lane:
                if before[lane] and mix.prompt[lane] > 0:
                    assert any(s.available(t) and split.lane(s) == lane.value for s in states), (
                        f"{lane} lost its last instance with traffic"
                    )
            t += 1.0
