"""Priority classes in the core: the queue's order, aging, and admission per class."""

from __future__ import annotations

import random

from _sched_helpers import ahead_of, bounded_of, predicted_wait_of

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    PeerLoad,
    Priority,
    Queued,
    Rejected,
    Scheduler,
    SharedView,
    Ticket,
)

FAR = 1e9
BATCH, INTERACTIVE = Priority.BATCH, Priority.INTERACTIVE


def one_slot(interactive_wait: float = 2.0, batch_wait: float = 30.0) -> Scheduler:
    """One instance with one running slot and no queue of its own: all waiting is ours."""
    limits = Limits(
        max_queue_per_instance=0,
        max_queue_wait_short=interactive_wait,
        batch_queue_wait_short=batch_wait,
    )
    sched = Scheduler([InstanceSpec("a", slots=1)], STRATEGIES["least_busy"](30.0), limits)
    sched.probe("a", True, 0.0, random.Random(0))
    return sched


def ticket(i: int, priority: Priority) -> Ticket:
    return Ticket(i, Lane.SHORT, FAR, priority=priority)


def test_an_interactive_request_goes_before_an_earlier_batch_one() -> None:
    rng = random.Random(0)
    sched = one_slot()
    assert isinstance(sched.submit(ticket(1, INTERACTIVE), 0.0, rng), Assigned)
    batch = sched.submit(ticket(2, BATCH), 0.0, rng)
    assert isinstance(batch, Queued)
    assert batch.wait_until == 30.0  # a batch request waits up to its class's limit
    interactive = sched.submit(ticket(3, INTERACTIVE), 1.0, rng)
    assert isinstance(interactive, Queued)
    assert interactive.wait_until == 3.0
    (placed,) = sched.release(1, Outcome.SUCCESS, 1.5, rng)
    assert isinstance(placed, Assigned)
    assert placed.ticket.id == 3
    (placed,) = sched.release(3, Outcome.SUCCESS, 2.0, rng)
    assert placed.ticket.id == 2  # then the batch one: delayed, not dropped


def test_a_batch_request_near_its_limit_goes_before_a_fresh_interactive_one() -> None:
    """Aging: the head whose wait runs out first goes first, so a batch request that has
    waited almost its whole limit is not overtaken again (it is not starved)."""
    rng = random.Random(0)
    sched = one_slot(interactive_wait=2.0, batch_wait=30.0)
    assert isinstance(sched.submit(ticket(1, INTERACTIVE), 0.0, rng), Assigned)
    assert isinstance(sched.submit(ticket(2, BATCH), 0.0, rng), Queued)  # until 30
    assert isinstance(sched.submit(ticket(3, INTERACTIVE), 29.0, rng), Queued)  # until 31
    (placed,) = sched.release(1, Outcome.SUCCESS, 29.5, rng)
    assert isinstance(placed, Assigned)
    assert placed.ticket.id == 2


def test_within_a_class_the_order_is_arrival() -> None:
    rng = random.Random(0)
    sched = one_slot()
    assert isinstance(sched.submit(ticket(1, BATCH), 0.0, rng), Assigned)
    for i, now in ((2, 0.1), (3, 0.2), (4, 0.3)):
        assert isinstance(sched.submit(ticket(i, BATCH), now, rng), Queued)
    order = []
    for done in (1, 2, 3):
        (placed,) = sched.release(done, Outcome.SUCCESS, 1.0 + done, rng)
        order.append(placed.ticket.id)
    assert order == [2, 3, 4]


def test_admission_predicts_each_class_from_its_own_departure_rate() -> None:
    """Batch requests leave one a second while batch ones wait; with ten batch requests
    waiting, a new one would wait 11 s, over its 10 s: refused at once. An interactive
    request arriving then is not judged by the batch rate and the batch queue: it waits,
    first in line."""
    rng = random.Random(0)
    sched = one_slot(interactive_wait=2.0, batch_wait=10.0)
    assert isinstance(sched.submit(ticket(1, BATCH), 0.0, rng), Assigned)
    for i in range(2, 16):
        assert isinstance(sched.submit(ticket(i, BATCH), 0.0, rng), Queued)
    for done, now in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)):
        (placed,) = sched.release(done, Outcome.SUCCESS, now, rng)
        assert placed.ticket.id == done + 1
    # Now: ticket 5 runs, 6..15 wait, batch drains at 1/s.
    assert predicted_wait_of(sched, Lane.SHORT, 4.0, priority=BATCH) == 11.0
    refused = sched.submit(ticket(20, BATCH), 4.0, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "predicted_wait"
    assert refused.retry_after == 1.0  # 11 s - 10 s
    assert predicted_wait_of(sched, Lane.SHORT, 4.0, priority=INTERACTIVE) is None  # unknown
    interactive = sched.submit(ticket(21, INTERACTIVE), 4.0, rng)
    assert isinstance(interactive, Queued)
    (placed,) = sched.release(5, Outcome.SUCCESS, 4.5, rng)
    assert placed.ticket.id == 21


def test_the_peers_batch_queue_is_not_ahead_of_an_interactive_request() -> None:
    """Of the other processes' queues, an interactive request waits only behind their
    interactive part; a batch request behind all of it."""
    rng = random.Random(0)
    sched = one_slot()
    sched.apply_shared(
        SharedView(
            loads={"a": PeerLoad(inflight=1)},
            queued={Lane.SHORT: 7},
            queued_batch={Lane.SHORT: 5},
            peers=1,
        ),
        0.0,
        rng,
    )
    assert ahead_of(sched, Lane.SHORT, priority=INTERACTIVE) == 2
    assert ahead_of(sched, Lane.SHORT, priority=BATCH) == 7


def test_share_tells_the_peers_how_many_batch_requests_wait() -> None:
    rng = random.Random(0)
    sched = one_slot()
    assert isinstance(sched.submit(ticket(1, INTERACTIVE), 0.0, rng), Assigned)
    for i, priority in ((2, BATCH), (3, BATCH), (4, INTERACTIVE)):
        assert isinstance(sched.submit(ticket(i, priority), 0.0, rng), Queued)
    share = sched.share(0.0)
    assert share.queued[Lane.SHORT] == 3
    assert share.queued_batch == {Lane.SHORT: 2}


def test_a_retry_keeps_its_class_and_waits_its_class_limit() -> None:
    rng = random.Random(0)
    sched = one_slot()
    assert isinstance(sched.submit(ticket(1, INTERACTIVE), 0.0, rng), Assigned)
    retry = Ticket(2, Lane.SHORT, FAR, exclude=frozenset({"b"}), priority=BATCH)
    queued = sched.submit(retry, 0.0, rng)
    assert isinstance(queued, Queued)
    assert queued.wait_until == 30.0


def test_a_batch_request_takes_a_running_slot_only() -> None:
    """An instance's own queue is served in arrival order: a batch request waits in the
    gateway's instead, where interactive ones go first; an interactive one may still
    queue at the instance (max_queue_per_instance)."""
    rng = random.Random(0)
    limits = Limits(max_queue_per_instance=4, max_queue_wait_short=2.0, batch_queue_wait_short=30.0)
    sched = Scheduler([InstanceSpec("a", slots=1)], STRATEGIES["least_busy"](30.0), limits)
    sched.probe("a", True, 0.0, rng)
    assert isinstance(sched.submit(ticket(1, BATCH), 0.0, rng), Assigned)  # the slot
    assert isinstance(sched.submit(ticket(2, BATCH), 0.0, rng), Queued)  # here, not there
    assert isinstance(sched.submit(ticket(3, INTERACTIVE), 0.0, rng), Assigned)
    assert ahead_of(sched, Lane.SHORT, priority=INTERACTIVE) == 1  # 3, at the instance
    assert sched.release(1, Outcome.SUCCESS, 1.0, rng) == []  # 3 runs in the freed slot
    (placed,) = sched.release(3, Outcome.SUCCESS, 2.0, rng)
    assert placed.ticket.id == 2


def test_batch_requests_never_fill_the_queue_for_interactive_ones() -> None:
    """With the gateway queue bound at 2: two waiting batch requests refuse a third with
    queue_full, but an interactive one still waits, and goes first; two waiting
    interactive requests refuse both classes."""
    rng = random.Random(0)
    limits = Limits(
        max_queue_per_instance=0,
        gateway_queue_size=2,
        max_queue_wait_short=2.0,
        batch_queue_wait_short=30.0,
    )
    sched = Scheduler([InstanceSpec("a", slots=1)], STRATEGIES["least_busy"](30.0), limits)
    sched.probe("a", True, 0.0, rng)
    assert isinstance(sched.submit(ticket(1, INTERACTIVE), 0.0, rng), Assigned)
    for i in (2, 3):
        assert isinstance(sched.submit(ticket(i, BATCH), 0.0, rng), Queued)
    full = sched.submit(ticket(4, BATCH), 0.0, rng)
    assert isinstance(full, Rejected)
    assert full.reason == "queue_full"
    assert (bounded_of(sched, Lane.SHORT, BATCH), bounded_of(sched, Lane.SHORT, INTERACTIVE)) == (
        2,
        0,
    )
    for i in (5, 6):
        assert isinstance(sched.submit(ticket(i, INTERACTIVE), 0.0, rng), Queued)
    for i, priority in ((7, INTERACTIVE), (8, BATCH)):
        refused = sched.submit(ticket(i, priority), 0.0, rng)
        assert isinstance(refused, Rejected)
        assert refused.reason == "queue_full"
    (placed,) = sched.release(1, Outcome.SUCCESS, 0.5, rng)
    assert placed.ticket.id == 5


def test_the_peers_batch_queue_does_not_fill_the_bound_for_interactive_ones() -> None:
    """Fleet-wide, the same: the other processes' batch requests count against the bound
    for batch requests only."""
    rng = random.Random(0)
    limits = Limits(max_queue_per_instance=0, gateway_queue_size=4)
    sched = Scheduler([InstanceSpec("a", slots=1)], STRATEGIES["least_busy"](30.0), limits)
    sched.probe("a", True, 0.0, rng)
    view = SharedView(
        loads={"a": PeerLoad(inflight=1)},
        queued={Lane.SHORT: 4},
        queued_batch={Lane.SHORT: 3},
        peers=1,
    )
    sched.apply_shared(view, 0.0, rng)
    assert (bounded_of(sched, Lane.SHORT, BATCH), bounded_of(sched, Lane.SHORT, INTERACTIVE)) == (
        4,
        1,
    )
    refused = sched.submit(ticket(1, BATCH), 0.0, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "queue_full"
    assert isinstance(sched.submit(ticket(2, INTERACTIVE), 0.0, rng), Queued)
