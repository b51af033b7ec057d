"""`max_long_running_per_instance`: long answers running on a shared instance, bounded."""

from __future__ import annotations

import random

from _sched_helpers import FAR, bring_up, make

from gateway.dispatch import (
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    PeerLoad,
    Queued,
    SharedView,
    Ticket,
)
from gateway.dispatch.scheduler import Scheduler


def _long(i: int, max_tokens: int = 32) -> Ticket:
    return Ticket(i, Lane.LONG, FAR, tokens=6000, max_tokens=max_tokens)


def test_a_long_request_waits_while_the_long_answers_running_fill_the_bound() -> None:
    """With one long prefill and two long answers at once, a third long request waits
    after both prefills are done, and takes the place the first answer frees at its end."""
    rng = random.Random(0)
    limits = Limits(max_long_per_instance=1, max_long_running_per_instance=2)
    sched = make(InstanceSpec("a", slots=16), limits=limits)
    bring_up(sched, rng)
    assert isinstance(sched.submit(_long(1), 0.0, rng), Assigned)
    assert isinstance(sched.submit(_long(2), 0.0, rng), Queued)  # the prefill place
    (second,) = sched.prefill_done(1, 0.3, rng)
    assert isinstance(second, Assigned)
    assert second.ticket.id == 2
    assert isinstance(sched.submit(_long(3), 0.3, rng), Queued)
    assert sched.prefill_done(2, 0.6, rng) == []  # prefill place free, running places full
    (third,) = sched.release(1, Outcome.SUCCESS, 0.9, rng)
    assert isinstance(third, Assigned)
    assert third.ticket.id == 3


def test_short_requests_are_not_bounded_by_it() -> None:
    """The bound counts long answers only: short requests still take any free slot."""
    rng = random.Random(0)
    limits = Limits(max_long_per_instance=1, max_long_running_per_instance=1)
    sched = make(InstanceSpec("a", slots=16), limits=limits)
    bring_up(sched, rng)
    assert isinstance(sched.submit(_long(1), 0.0, rng), Assigned)
    sched.prefill_done(1, 0.3, rng)
    assert isinstance(sched.submit(_long(2), 0.3, rng), Queued)
    short = Ticket(3, Lane.SHORT, FAR, tokens=200, max_tokens=32)
    assert isinstance(sched.submit(short, 0.3, rng), Assigned)


def test_the_other_processes_long_answers_count_toward_it() -> None:
    """Long answers the shared view reports there take running places too."""
    rng = random.Random(0)
    limits = Limits(max_long_per_instance=2, max_long_running_per_instance=2)
    sched = make(InstanceSpec("a", slots=16), InstanceSpec("b", slots=16), limits=limits)
    bring_up(sched, rng)
    view = SharedView(loads={"a": PeerLoad(2, 0, long_prefilling=0, long_running=2)}, peers=1)
    sched.apply_shared(view, 0.0, rng)
    for i in (1, 2):
        decision = sched.submit(_long(i), 0.0, rng)
        assert isinstance(decision, Assigned)
        assert decision.instance == "b"
    assert isinstance(sched.submit(_long(3), 0.0, rng), Queued)


def test_without_the_bound_long_answers_running_do_not_hold_a_place() -> None:
    """The default (None) bounds long prefills only, as before."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=16), limits=Limits(max_long_per_instance=1))
    bring_up(sched, rng)
    for i in range(1, 6):
        assert isinstance(sched.submit(_long(i), float(i), rng), Assigned)
        sched.prefill_done(i, i + 0.3, rng)


def _one_card(limits: Limits) -> tuple[Scheduler, random.Random]:
    """One shared instance with 16 slots, up."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=16), limits=limits)
    bring_up(sched, rng)
    return sched, rng


def _learn_the_prefill_rate(limits: Limits) -> tuple[Scheduler, random.Random]:
    """One instance that has seen a 6,000-token prefill take 0.3 s, and is empty again."""
    sched, rng = _one_card(limits)
    assert isinstance(sched.submit(_long(1), 0.0, rng), Assigned)
    sched.prefill_done(1, 0.3, rng, ttft=0.3)
    sched.release(1, Outcome.SUCCESS, 1.0, rng)
    return sched, rng


def test_a_long_answer_long_enough_to_absorb_the_stalls_holds_no_running_place() -> None:
    """Bound 1, TPOT objective 50 ms: one 0.3 s stall over 512 tokens is 0.6 ms, far
    under half the objective, so long prompts keep coming while such answers run. Over
    8 tokens it is 37.5 ms: that answer holds its place and the next prompt waits."""
    limits = Limits(
        max_long_per_instance=1, max_long_running_per_instance=1, long_tpot_objective=0.05
    )
    sched, rng = _learn_the_prefill_rate(limits)
    for i, t in ((2, 1.0), (3, 1.3), (4, 1.6)):
        assert isinstance(sched.submit(_long(i, 512), t, rng), Assigned)
        sched.prefill_done(i, t + 0.3, rng, ttft=0.3)
    assert isinstance(sched.submit(_long(5, 8), 1.9, rng), Assigned)
    sched.prefill_done(5, 2.2, rng, ttft=0.3)
    assert isinstance(sched.submit(_long(6, 512), 2.2, rng), Queued)
    (sixth,) = sched.release(5, Outcome.SUCCESS, 2.5, rng)
    assert isinstance(sixth, Assigned)
    assert sixth.ticket.id == 6


def test_an_answer_placed_before_the_rate_is_known_counts() -> None:
    """With no prefill seen yet the stall is unknown, and the answer counts, as before."""
    sched, rng = _one_card(Limits(max_long_per_instance=1, max_long_running_per_instance=1))
    assert isinstance(sched.submit(_long(1, 4096), 0.0, rng), Assigned)
    sched.prefill_done(1, 0.3, rng, ttft=0.3)
    assert isinstance(sched.submit(_long(2, 4096), 0.3, rng), Queued)
