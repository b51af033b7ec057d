"""Learned instance speed, the slow-card flag and least_time scoring: plain calls, no loop."""

from __future__ import annotations

import math
import random

import pytest

from gateway.dispatch import InstanceSpec, InstanceState, Lane, Ticket
from gateway.dispatch.least_time import LeastTime
from gateway.dispatch.speed import (
    MIN_SAMPLES,
    Ewma,
    Speed,
    relative_speed,
    update_slow_flags,
)


def test_estimate_converges_on_a_constant_speed() -> None:
    """Fed the same sample, the estimate equals it."""
    rate = Ewma(higher_is_better=True)
    for _ in range(20):
        rate.update(1000.0)
    assert rate.value == pytest.approx(1000.0)
    assert rate.samples == 20


def test_estimate_reacts_fast_to_a_slowdown_and_recovers_slowly() -> None:
    """A drop to 40% shows within three samples; the way back takes many more."""
    rate = Ewma(higher_is_better=True, value=1000.0, samples=10)
    for _ in range(3):
        rate.update(400.0)
    assert rate.value is not None
    assert rate.value < 500
    for _ in range(3):
        rate.update(1000.0)
    assert rate.value < 650
    for _ in range(40):
        rate.update(1000.0)
    assert rate.value == pytest.approx(1000.0, rel=0.01)


def test_tpot_estimate_treats_higher_as_slower() -> None:
    """For time per token a rise is the slowdown, so it is taken at once."""
    tpot = Ewma(higher_is_better=False, value=0.02, samples=10)
    tpot.update(0.05)
    assert tpot.value == pytest.approx(0.035)
    tpot.update(0.01)
    assert tpot.value == pytest.approx(0.035 - 0.1 * 0.025)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf * 0])
def test_bad_samples_are_ignored(bad: float) -> None:
    """Zero, negative and NaN samples never reach the estimate."""
    rate = Ewma(higher_is_better=True)
    rate.update(bad)
    assert (rate.value, rate.samples) == (None, 0)


def test_no_division_by_zero_on_an_instant_first_token() -> None:
    """A first token in zero seconds, or a zero-token prompt, teaches nothing and raises nothing."""
    speed = Speed.new()
    speed.observe_prefill(100, 0.0)
    speed.observe_prefill(0, 1.0)
    assert speed.prefill.value is None


def test_memory_is_constant_whatever_the_traffic() -> None:
    """An estimate holds two numbers however many samples it saw."""
    rate = Ewma(higher_is_better=True)
    for i in range(10_000):
        rate.update(1000.0 + i % 7)
    assert set(vars(rate)) == {"higher_is_better", "value", "samples"}


def _speeds(*rates: float, samples: int = MIN_SAMPLES) -> dict[str, Speed]:
    out = {}
    for i, rate in enumerate(rates):
        speed = Speed.new()
        speed.prefill = Ewma(higher_is_better=True, value=rate, samples=samples)
        out[f"i{i}"] = speed
    return out


def test_slow_card_is_flagged_and_cleared_with_hysteresis() -> None:
    """Below 60% of the median for two rounds a card is flagged; it clears only above 80%."""
    speeds = _speeds(1000, 1000, 1000, 400)
    assert update_slow_flags(speeds) == {}  # one round is not yet "stays below"
    assert update_slow_flags(speeds) == {"i3": True}
    assert update_slow_flags(speeds) == {}
    speeds["i3"].prefill.value = 700  # better, but inside the hysteresis band
    assert update_slow_flags(speeds) == {}
    assert update_slow_flags(speeds) == {}
    assert speeds["i3"].slow
    speeds["i3"].prefill.value = 850
    assert update_slow_flags(speeds) == {}
    assert update_slow_flags(speeds) == {"i3": False}


def test_one_round_out_of_line_does_not_flip_the_flag() -> None:
    """A single noisy round below (or above) the line changes nothing."""
    speeds = _speeds(1000, 1000, 1000, 400)
    update_slow_flags(speeds)
    speeds["i3"].prefill.value = 1000
    assert update_slow_flags(speeds) == {}
    speeds["i3"].prefill.value = 400
    assert update_slow_flags(speeds) == {}
    assert not speeds["i3"].slow


def test_no_flag_without_enough_history() -> None:
    """A card with few samples, or a fleet with one measured card, is never flagged."""
    assert update_slow_flags(_speeds(1000, 1000, 300, samples=MIN_SAMPLES - 1)) == {}
    lonely = _speeds(1000, 300)
    lonely["i0"].prefill.samples = 0
    assert update_slow_flags(lonely) == {}


def test_relative_speed_takes_the_worse_of_prefill_and_decode() -> None:
    """A card fast at prefill but slow at decode counts as slow."""
    speed = Speed.new()
    speed.prefill = Ewma(higher_is_better=True, value=1000, samples=9)
    speed.tpot = Ewma(higher_is_better=False, value=0.05, samples=9)
    assert relative_speed(speed, 1000, 0.02) == pytest.approx(0.4)
    assert relative_speed(Speed.new(), 1000, 0.02) == 1.0


def _fleet(*rates: float | None, tpots: tuple[float | None, ...] = ()) -> list[InstanceState]:
    fleet = []
    for i, rate in enumerate(rates):
        state = InstanceState(InstanceSpec(f"i{i}", slots=8), up=True)
        if rate is not None:
            state.speed.prefill = Ewma(higher_is_better=True, value=rate, samples=9)
        tpot = tpots[i] if i < len(tpots) else None
        if tpot is not None:
            state.speed.tpot = Ewma(higher_is_better=False, value=tpot, samples=9)
        fleet.append(state)
    return fleet


def _ticket(tokens: int, max_tokens: int = 16) -> Ticket:
    return Ticket(1, Lane.SHORT, 100.0, tokens=tokens, max_tokens=max_tokens)


def test_least_time_predicts_work_ahead_over_learned_rate() -> None:
    """Predicted TTFT is (tokens ahead + own tokens) / the instance's prefill rate."""
    fleet = _fleet(1000.0, 400.0)
    fleet[0].pending_prefill_tokens = 600
    strategy = LeastTime(stale_after=30)
    costs = strategy.costs(fleet, fleet, _ticket(400, 0), now=0.0)  # no output: TTFT alone
    assert costs["i0"] == pytest.approx(1.0)
    assert costs["i1"] == pytest.approx(1.0)
    fleet[0].pending_prefill_tokens = 500
    pick = strategy.choose(fleet, fleet, _ticket(400, 0), 0.0, random.Random(0))
    assert pick.name == "i0"


def test_least_time_sends_work_away_from_a_slow_card_that_least_busy_would_pick() -> None:
    """With one request queued on each fast card and none on the slow one, a long prompt
    still goes to a fast card when the slow card's prediction is worse."""
    fleet = _fleet(1000.0, 1000.0, 200.0)
    fleet[0].pending_prefill_tokens = fleet[1].pending_prefill_tokens = 500
    pick = LeastTime(30).choose(fleet, fleet, _ticket(2000), 0.0, random.Random(0))
    assert pick.name in {"i0", "i1"}


def test_a_long_prompt_goes_where_its_prefill_stalls_the_fewest_answers() -> None:
    """A prefill delays every request in flight on its instance by its own length, so a
    6,000-token prompt goes to an idle slow card rather than a fast one with answers
    decoding: 0.75 s there against 0.3 s plus 0.3 s for each of four answers."""
    fleet = _fleet(20000.0, 20000.0, 8000.0)
    fleet[0].inflight, fleet[1].inflight = 6, 4
    costs = LeastTime(30).costs(fleet, fleet, _ticket(6000, 0), 0.0)
    assert costs == {
        "i0": pytest.approx(0.3 + 6 * 0.3),
        "i1": pytest.approx(0.3 + 4 * 0.3),
        "i2": pytest.approx(0.75),
    }
    assert LeastTime(30).choose(fleet, fleet, _ticket(6000, 0), 0.0, random.Random(0)).name == "i2"


def test_the_stall_never_costs_a_request_its_ttft_objective() -> None:
    """The stall a long prompt would add for others decides only among the instances where
    its own first token is predicted within the lane's TTFT objective; with none in time,
    the whole cost decides."""
    fleet = _fleet(20000.0, 20000.0)
    fleet[0].inflight = 6  # starts at once (0.3 s), stalls six answers (1.8 s)
    fleet[1].pending_prefill_tokens = 12000  # two prefills ahead: first token at 0.9 s
    fleet[1].inflight = 2
    strategy = LeastTime(30)
    ticket = Ticket(1, Lane.LONG, 100.0, tokens=6000, max_tokens=0)
    assert strategy.choose(fleet, fleet, ticket, 0.0, random.Random(0)).name == "i1"
    strategy.ttft_objectives = {Lane.LONG: 0.5}
    assert strategy.choose(fleet, fleet, ticket, 0.0, random.Random(0)).name == "i0"
    strategy.ttft_objectives = {Lane.LONG: 0.2, Lane.SHORT: 5.0}  # neither in time
    assert strategy.choose(fleet, fleet, ticket, 0.0, random.Random(0)).name == "i1"


def test_decode_speed_weighs_in_for_long_outputs() -> None:
    """For a long output, an instance decoding slower than the TPOT objective loses even
    with an idle prefill; for a one-token output its idle prefill wins."""
    fleet = _fleet(1000.0, 1000.0, tpots=(0.02, 0.15))
    fleet[0].pending_prefill_tokens = 200
    strategy = LeastTime(30, {Lane.SHORT: 0.1})
    assert strategy.choose(fleet, fleet, _ticket(100, 1), 0.0, random.Random(0)).name == "i1"
    assert strategy.choose(fleet, fleet, _ticket(100, 500), 0.0, random.Random(0)).name == "i0"


def test_a_slow_decoder_within_the_objective_is_judged_on_ttft_alone() -> None:
    """A card decoding 2.5x slower but inside the TPOT objective pays no decode penalty."""
    fleet = _fleet(1000.0, 1000.0, tpots=(0.02, 0.05))
    fleet[0].pending_prefill_tokens = 200
    strategy = LeastTime(30, {Lane.SHORT: 0.1})
    costs = strategy.costs(fleet, fleet, _ticket(100, 500), 0.0)
    assert costs == {"i0": pytest.approx(0.3), "i1": pytest.approx(0.1)}


def test_instances_without_history_are_assumed_median_speed() -> None:
    """A new instance is predicted at the fleet median, neither ideal nor hopeless."""
    fleet = _fleet(1000.0, 3000.0, None)
    costs = LeastTime(30).costs(fleet, fleet, _ticket(1000, 0), 0.0)
    assert costs["i2"] == pytest.approx(1000 / 2000)


def test_no_history_anywhere_falls_back_to_least_prefill_work() -> None:
    """Before any sample, least_time picks the instance with the least prompt work queued."""
    fleet = _fleet(None, None, None)
    fleet[0].pending_prefill_tokens = 100
    fleet[2].pending_prefill_tokens = 50
    assert LeastTime(30).choose(fleet, fleet, _ticket(10), 0.0, random.Random(0)).name == "i1"


def test_least_time_ties_spread_at_random() -> None:
    """Equal predictions are broken at random, not toward the first instance."""
    fleet = _fleet(1000.0, 1000.0, 1000.0)
    rng = random.Random(7)
    picks = [LeastTime(30).choose(fleet, fleet, _ticket(10), 0.0, rng).name for _ in range(300)]
    assert all(60 < picks.count(name) < 140 for name in ("i0", "i1", "i2"))
