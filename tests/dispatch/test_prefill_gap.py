"""A breather after each long prefill (prefill_gap.py): the card's long place stays
closed for a share of the prefill's time while answers run there, so they decode before
the next long prefill, unless the long request has already waited that long."""

from __future__ import annotations

import random

import pytest
from _sched_helpers import FAR, bring_up, make

from gateway.dispatch import (
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    Queued,
    Scheduler,
    Ticket,
)
from gateway.dispatch.prefill_gap import gap_after
from gateway.dispatch.speed import Ewma


def _long(i: int) -> Ticket:
    return Ticket(i, Lane.LONG, FAR, tokens=6000, max_tokens=32)


def _short(i: int) -> Ticket:
    return Ticket(i, Lane.SHORT, FAR, tokens=200, max_tokens=32)


def _fleet(*names: str, gap: float = 0.3) -> Scheduler:
    """Cards of 20,000 tokens/s with one long place each, three answers running on each
    but the first; long prompt 1 prefills on the first from 0 to 0.3 s while short
    prompt 2 runs there: a gap of 0.3 x 0.3 s."""
    rng = random.Random(0)
    limits = Limits(max_long_per_instance=1, lane_split=False, long_prefill_gap=gap)
    sched = make(*(InstanceSpec(n, slots=16) for n in names), limits=limits)
    bring_up(sched, rng)
    for state in sched.states:
        state.speed.prefill = Ewma(higher_is_better=True, value=20000.0, samples=9)
    for state in sched.states[1:]:
        state.inflight = 3
    assert sched.submit(_long(1), 0.0, rng) == Assigned(_long(1), names[0])
    assert sched.submit(_short(2), 0.0, rng) == Assigned(_short(2), names[0])
    return sched


def test_the_gap_is_a_share_of_the_prefill_at_the_learned_rate() -> None:
    assert gap_after(6000, 20000.0, 0.3) == 0.09
    assert gap_after(6000, None, 0.3) == 0.0  # no rate learned yet: no gap
    assert gap_after(6000, 20000.0, 0.0) == 0.0


def test_a_long_prompt_waits_out_the_breather_and_starts_when_it_ends() -> None:
    rng = random.Random(0)
    sched = _fleet("a")
    assert sched.prefill_done(1, 0.3, rng, ttft=0.3) == []
    assert isinstance(sched.submit(_long(3), 0.35, rng), Queued)
    wake = sched.wake_at(0.35)
    assert wake == pytest.approx(0.39)
    assert sched.drain(0.38, rng) == []
    assert sched.drain(0.39, rng) == [Assigned(_long(3), "a")]
    assert sched.wake_at(0.39) is None


def test_a_card_without_a_breather_takes_it_at_once() -> None:
    """least_busy would pick `a` (two in flight against three); its breather sends the
    long prompt to `b`, whose decoding answers have had no prefill since."""
    rng = random.Random(0)
    sched = _fleet("a", "b")
    sched.prefill_done(1, 0.3, rng, ttft=0.3)
    assert sched.submit(_long(3), 0.35, rng) == Assigned(_long(3), "b")


def test_a_long_prompt_that_has_waited_the_gap_already_is_not_held() -> None:
    """Queued behind long prompt 1 since 0.1 s, it has waited 0.2 s when the place
    frees: a backlog gets no breather, the card's time is wanted."""
    rng = random.Random(0)
    sched = _fleet("a")
    assert isinstance(sched.submit(_long(3), 0.1, rng), Queued)
    assert sched.prefill_done(1, 0.3, rng, ttft=0.3) == [Assigned(_long(3), "a")]


def test_it_waits_at_most_the_gap_from_when_it_was_queued() -> None:
    """Queued at 0.25 s, it has waited the 0.09 s gap at 0.34 s, before the breather
    ends at 0.39 s: the scheduler asks to be woken then, and it starts."""
    rng = random.Random(0)
    sched = _fleet("a")
    assert isinstance(sched.submit(_long(3), 0.25, rng), Queued)
    assert sched.prefill_done(1, 0.3, rng, ttft=0.3) == []
    wake = sched.wake_at(0.3)
    assert wake == pytest.approx(0.34)
    assert sched.drain(wake, rng) == [Assigned(_long(3), "a")]


def test_a_card_with_nothing_running_gets_no_breather() -> None:
    rng = random.Random(0)
    sched = _fleet("a")
    sched.prefill_done(1, 0.3, rng, ttft=0.3)
    sched.release(1, Outcome.SUCCESS, 0.31, rng)
    sched.release(2, Outcome.SUCCESS, 0.31, rng)
    assert sched.submit(_long(3), 0.32, rng) == Assigned(_long(3), "a")


def test_off_by_default() -> None:
    rng = random.Random(0)
    sched = _fleet("a", gap=0.0)
    sched.prefill_done(1, 0.3, rng, ttft=0.3)
    assert sched.submit(_long(3), 0.3, rng) == Assigned(_long(3), "a")
    assert sched.wake_at(0.3) is None
