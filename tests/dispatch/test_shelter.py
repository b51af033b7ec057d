"""least_time keeps short answers out of long prefills: short prompts gather where long
ones are least likely to land."""

from __future__ import annotations

import random

from _sched_helpers import FAR, bring_up, make

from gateway.dispatch import (
    Assigned,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
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


def test_a_long_prompt_starts_at_once_where_a_long_place_is_free() -> None:
    """With `b` prefilling a long prompt (its one long place taken) and six answers
    decoding on `a`, the next long prompt starts on `a` at once: it does not wait for
    b's place, however many answers its prefill will stall."""
    rng = random.Random(0)
    limits = Limits(max_long_per_instance=1)
    sched = make(
        InstanceSpec("a", slots=16),
        InstanceSpec("b", slots=16),
        strategy="least_time",
        limits=limits,
    )
    bring_up(sched, rng)
    sched.instances.states[0].inflight = 6
    assert sched.submit(_long(1), 0.0, rng) == Assigned(_long(1), "b")
    assert sched.submit(_long(2), 0.0, rng) == Assigned(_long(2), "a")
