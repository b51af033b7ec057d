"""least_time keeps short answers out of long prefills: short prompts gather where long
ones are least likely to land, and a long prompt waits for a place about to free where
its prefill stalls fewer answers."""

from __future__ import annotations

import random

import pytest
from _sched_helpers import FAR, bring_up, make

from gateway.dispatch import (
    Assigned,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    Queued,
    Rejected,
    Scheduler,
    Ticket,
)
from gateway.dispatch.least_time import LeastTime
from gateway.dispatch.speed import Ewma


def _card(name: str, rate: float, tpot: float, inflight: int = 0) -> InstanceState:
    state = InstanceState(InstanceSpec(name, slots=16), up=True)
    state.speed.prefill = Ewma(higher_is_better=True, value=rate, samples=9)
    state.speed.tpot = Ewma(higher_is_better=False, value=tpot, samples=9)
    state.inflight = inflight
    return state


def _short(i: int = 1) -> Ticket:
    return Ticket(i, Lane.SHORT, FAR, tokens=200, max_tokens=32)


def _long(i: int, deadline: float = FAR) -> Ticket:
    return Ticket(i, Lane.LONG, deadline, tokens=6000, max_tokens=32)


def test_a_short_prompt_gathers_with_others_while_long_answers_run() -> None:
    """Of three like cards, a short prompt goes to the one with the most answers in flight
    while a long request runs in the fleet (the next long prefill avoids that card), and
    to the emptiest when none does."""
    fleet = [_card("i0", 20000, 0.02, 3), _card("i1", 20000, 0.02, 1), _card("i2", 20000, 0.02)]
    strategy = LeastTime(30)
    assert strategy.choose(fleet, fleet, _short(), 0.0, random.Random(0)).name == "i2"
    fleet[1].long_running = 1
    assert strategy.choose(fleet, fleet, _short(), 0.0, random.Random(0)).name == "i0"


def test_a_short_prompt_does_not_shelter_where_its_own_answer_would_be_slow() -> None:
    """A crowded card is chosen only where the short prompt's own predicted end-to-end is
    within 10% (and 20 ms) of its best: a slow card's decode puts it out of reach."""
    slow = _card("slow", 8000, 0.05, 6)
    fast = _card("fast", 20000, 0.02, 1)
    fast.long_running = 1
    fleet = [slow, fast]
    assert LeastTime(30).choose(fleet, fleet, _short(), 0.0, random.Random(0)).name == "fast"


def test_a_short_prompt_does_not_shelter_behind_a_prefill() -> None:
    """A crowded card whose prefill queue would hold the short prompt's first token more
    than 20 ms longer is not chosen, however long its answer (10% of which would cover
    the wait)."""
    crowded = _card("crowded", 20000, 0.02, 6)
    crowded.pending_prefill_tokens = 6000  # 0.3 s ahead of its first token
    crowded.long_running = 1
    fleet = [crowded, _card("idle", 20000, 0.02)]
    ticket = Ticket(1, Lane.SHORT, FAR, tokens=200, max_tokens=2000)  # 40 s of decode
    assert LeastTime(30).choose(fleet, fleet, ticket, 0.0, random.Random(0)).name == "idle"


def test_with_no_card_near_its_best_on_both_counts_the_cost_decides() -> None:
    """Where the quickest first token (a slow card, idle) and the quickest answer (a fast
    one with a prefill queued) are on different cards, none shelters: the cost decides."""
    slow = _card("slow", 8000, 0.05, 1)
    fast = _card("fast", 20000, 0.02, 6)
    fast.pending_prefill_tokens = 2000  # 0.1 s ahead of its first token
    fast.long_running = 1
    fleet = [slow, fast]
    ticket = Ticket(1, Lane.SHORT, FAR, tokens=200, max_tokens=100)
    strategy = LeastTime(30)
    costs = strategy.costs(fleet, fleet, ticket, 0.0)
    assert costs["slow"] < costs["fast"]  # 0.05 against 0.17: the short decode is in time
    assert strategy.choose(fleet, fleet, ticket, 0.0, random.Random(0)).name == "slow"


def _waiting_fleet(busy: int = 6) -> Scheduler:
    """Two like cards: `a` with `busy` answers decoding, `b` prefilling a long prompt (its
    one long place taken); each long prefill takes 1.2 s at the prior rate, and a long
    request waits in the gateway queue for at most 3 s."""
    rng = random.Random(0)
    limits = Limits(max_long_per_instance=1, max_queue_wait_long=3.0)
    sched = make(
        InstanceSpec("a", slots=16),
        InstanceSpec("b", slots=16),
        strategy="least_time",
        limits=limits,
    )
    bring_up(sched, rng)
    sched.states[0].inflight = busy
    first = sched.submit(_long(1), 0.0, rng)
    assert isinstance(first, Assigned)
    assert first.instance == "b"
    return sched


def test_a_long_prompt_waits_for_a_place_about_to_free_behind_fewer_answers() -> None:
    """On `a` its prefill would stall six answers (1.2 s + 6 x 1.2 s); behind b's prefill
    it stalls one (2.4 s + 1.2 s): it waits, and takes b's place when that prefill ends."""
    rng = random.Random(0)
    sched = _waiting_fleet()
    assert isinstance(sched.submit(_long(2), 0.0, rng), Queued)
    (placed,) = sched.prefill_done(1, 1.2, rng)
    assert placed == Assigned(_long(2), "b")


def test_it_does_not_wait_to_save_half_its_cost_or_less() -> None:
    """With four answers on `a` (1.2 s + 4 x 1.2 s) against b's place (2.4 s + 1.2 s)
    the wait would save 40%: it starts on `a` at once."""
    rng = random.Random(0)
    sched = _waiting_fleet(busy=4)
    assert sched.submit(_long(2), 0.0, rng) == Assigned(_long(2), "a")


def test_it_does_not_wait_with_another_long_request_queued_behind_it() -> None:
    """A queue means every place is wanted: the oldest takes the free place at once."""
    rng = random.Random(0)
    sched = _waiting_fleet()
    assert isinstance(sched.submit(_long(2), 0.0, rng), Queued)
    assert isinstance(sched.submit(_long(3), 0.1, rng), Queued)
    assert sched.drain(0.2, rng) == [Assigned(_long(2), "a")]


def test_it_does_not_wait_beyond_its_ttft_objective() -> None:
    """Behind b's prefill its first token would come at 2.4 s: with a 2 s objective it
    starts on `a` at once."""
    rng = random.Random(0)
    sched = _waiting_fleet()
    assert isinstance(sched.strategy, LeastTime)
    sched.strategy.ttft_objectives = {Lane.LONG: 2.0}
    assert sched.submit(_long(2), 0.0, rng) == Assigned(_long(2), "a")


def test_least_busy_never_waits_while_a_place_is_free() -> None:
    """Waiting for a better place is least_time's judgement; least_busy places at once."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=16),
        InstanceSpec("b", slots=16),
        limits=Limits(max_long_per_instance=1),
    )
    bring_up(sched, rng)
    sched.states[0].inflight = 5
    assert sched.submit(_long(1), 0.0, rng) == Assigned(_long(1), "b")
    assert sched.submit(_long(2), 0.0, rng) == Assigned(_long(2), "a")


def test_when_its_wait_runs_out_it_starts_where_it_can() -> None:
    """A request that waited by choice is not refused when its queue wait runs out while
    a place is free: it starts there. Past its deadline it is refused as before."""
    rng = random.Random(0)
    sched = _waiting_fleet()
    assert isinstance(sched.submit(_long(2), 0.0, rng), Queued)
    wait_until = sched.wait_until(2)
    assert wait_until == 3.0
    assert sched.expire(2, wait_until, rng) == [Assigned(_long(2), "a")]
    sched = _waiting_fleet()
    assert isinstance(sched.submit(_long(3, deadline=1.0), 0.0, rng), Queued)
    (refused,) = sched.expire(3, 1.0, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "deadline"


def _slow_and_fast_fleet(slow_flag: bool = True, newest_deadline: float = FAR) -> Scheduler:
    """`slow` prefills 2,000 tokens/s (a long prompt's first token after 3 s), `fast`
    20,000 and is prefilling long prompt 1 (its one long place taken: 0.6 s for the next);
    `slow_flag`: the gateway has flagged `slow` a slow card. Long prompt 2 waits for the
    fast place by choice, and 3 queues behind it."""
    rng = random.Random(0)
    limits = Limits(max_long_per_instance=1, max_queue_wait_long=30.0)
    sched = make(
        InstanceSpec("fast", slots=16),
        InstanceSpec("slow", slots=16),
        strategy="least_time",
        limits=limits,
    )
    bring_up(sched, rng)
    for state, rate in zip(sched.states, (20000.0, 2000.0), strict=True):
        state.speed.prefill = Ewma(higher_is_better=True, value=rate, samples=9)
        state.speed.tpot = Ewma(higher_is_better=False, value=0.02, samples=9)
    sched.states[1].speed.slow = slow_flag
    assert sched.submit(_long(1), 0.0, rng) == Assigned(_long(1), "fast")
    assert isinstance(sched.submit(_long(2), 0.0, rng), Queued)
    assert isinstance(sched.submit(_long(3, newest_deadline), 0.0, rng), Queued)
    return sched


def test_the_slow_place_goes_to_the_newest_long_prompt_in_the_queue() -> None:
    """The oldest would see its first token after 3 s on the slow card, after 0.6 s once
    the fast card's prefill ends: the newest takes the slow place, the oldest the fast
    one, so the slow place is used as soon as without the swap."""
    rng = random.Random(0)
    sched = _slow_and_fast_fleet()
    assert sched.drain(0.1, rng) == [Assigned(_long(3), "slow")]
    assert sched.prefill_done(1, 0.3, rng) == [Assigned(_long(2), "fast")]


def test_only_a_card_flagged_slow_is_handed_to_the_newest() -> None:
    """Unflagged, the card is one like the others whose prediction is off for now (an
    even fleet's scrape lag): the oldest takes the place, first come first served."""
    rng = random.Random(0)
    sched = _slow_and_fast_fleet(slow_flag=False)
    assert sched.drain(0.1, rng) == [Assigned(_long(2), "slow")]


@pytest.mark.parametrize(("slow_rate", "starts"), [(8000.0, 3), (9500.0, 2)])
def test_the_newest_takes_the_slow_place_only_for_a_tenth_sooner(
    slow_rate: float, starts: int
) -> None:
    """Behind fast's prefill the oldest's first token comes after 0.6 s. The slow card
    now takes 0.75 s (8,000 tokens/s): more than 10% later, so the newest takes it. Or
    it takes 0.63 s: less, so the oldest does."""
    rng = random.Random(0)
    sched = _slow_and_fast_fleet()
    sched.states[1].speed.prefill = Ewma(higher_is_better=True, value=slow_rate, samples=9)
    assert sched.drain(0.1, rng) == [Assigned(_long(starts), "slow")]


def test_a_newest_past_its_deadline_is_not_handed_the_place() -> None:
    rng = random.Random(0)
    sched = _slow_and_fast_fleet(newest_deadline=0.05)
    placed, refused = sched.drain(0.1, rng)
    assert placed == Assigned(_long(2), "slow")
    assert isinstance(refused, Rejected)
    assert (refused.ticket.id, refused.reason) == (3, "deadline")
