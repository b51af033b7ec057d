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


def _long(i: int) -> Ticket:
    return Ticket(i, Lane.LONG, FAR, tokens=6000, max_tokens=32)


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
