"""Every way out of a wait in the gateway queue, on asyncio's loop and on uvloop.

Modelled on httpcore's `test_cancellations.py`: each test drives the Dispatcher into one
exit (placed, expired, cancelled, placed-and-cancelled in one pass, placed-and-expired in
one pass) and checks that the scheduler holds exactly what a caller still uses.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from prometheus_client import CollectorRegistry

from gateway import errors
from gateway.dispatch import (
    STRATEGIES,
    InstanceSpec,
    Lane,
    Limits,
    LocalShare,
    Outcome,
    PeerLoad,
    Scheduler,
    SharedView,
)
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.shared_codec import combine, decode, encode
from gateway.observe.metrics import Metrics

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def run(loop_name: str, scenario: Callable[[], Awaitable[Any]]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(scenario())  # type: ignore[arg-type]


def one_slot(max_queue_wait: float = 60.0) -> Dispatcher:
    """A dispatcher over one instance with one slot and no queue at the instance."""
    limits = Limits(
        max_queue_per_instance=0,
        max_queue_wait_short=max_queue_wait,
        max_queue_wait_long=max_queue_wait,
        queue_retry_after=3.0,
    )
    scheduler = Scheduler([InstanceSpec("a", slots=1)], STRATEGIES["least_busy"](30.0), limits)
    dispatcher = Dispatcher(scheduler, Metrics(CollectorRegistry()), rng=random.Random(0))
    dispatcher.probe("a", True)
    return dispatcher


def rejections(dispatcher: Dispatcher, reason: str) -> float:
    value: float = dispatcher.metrics.rejections.labels(reason)._value.get()
    return value


@pytest.mark.parametrize("loop_name", LOOPS)
def test_place_given_in_the_pass_its_deadline_fires_is_not_leaked(loop_name: str) -> None:
    """A release 5 ms before a queued request's deadline, then 20 ms of loop work: no slot leaks.

    uvloop runs the due timer before the woken task; the old wait then answered 504 and
    the scheduler kept the place it had given, forever.
    """

    async def scenario() -> None:
        dispatcher = one_slot()
        now = dispatcher.clock()
        first = dispatcher.new_ticket(Lane.SHORT, now + 60)
        assert await dispatcher.acquire(first) == "a"
        second = dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 0.05)
        waiter = asyncio.create_task(dispatcher.acquire(second))
        await asyncio.sleep(0)

        def release_then_stall() -> None:
            dispatcher.release(first.id, Outcome.SUCCESS)
            time.sleep(0.02)  # the loop is busy until past the waiter's deadline

        # From the ready queue, as a finished stream's release would run: the woken
        # waiter's step then lands in the next pass, after that pass's due timers.
        loop = asyncio.get_running_loop()
        loop.call_later(0.045, loop.call_soon, release_then_stall)
        result = (await asyncio.gather(waiter, return_exceptions=True))[0]
        if result == "a":  # it got the place in time and uses it
            assert dispatcher.snapshot().inflight == 1
            dispatcher.release(second.id, Outcome.SUCCESS)
        else:
            assert isinstance(result, errors.QueueTimeout), result
        assert dispatcher.snapshot().inflight == 0
        assert dispatcher.snapshot().queues[Lane.SHORT] == 0

    run(loop_name, scenario)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_queued_request_whose_wait_runs_out_gets_503_counted_once(loop_name: str) -> None:
    """A queued request that never reached an instance answers 503 + Retry-After, counted once."""

    async def scenario() -> None:
        dispatcher = one_slot(max_queue_wait=0.05)
        held = dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60)
        await dispatcher.acquire(held)
        started = time.monotonic()
        with pytest.raises(errors.QueueTimeout) as info:
            await dispatcher.acquire(dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60))
        assert 0.04 < time.monotonic() - started < 1.0
        assert info.value.status == 503
        assert info.value.retry_after == 3.0
        response = info.value.response()
        assert response.headers["Retry-After"] == "3"
        assert rejections(dispatcher, "deadline") == 1
        dispatcher.release(held.id, Outcome.SUCCESS)
        assert dispatcher.snapshot().inflight == 0

    run(loop_name, scenario)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_expiry_and_a_freed_place_in_one_pass_count_once(loop_name: str) -> None:
    """The wait timer and a release due together: one outcome, one count, nothing held."""

    async def scenario() -> None:
        dispatcher = one_slot(max_queue_wait=0.03)
        held = dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60)
        await dispatcher.acquire(held)
        waiting = dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60)
        waiter = asyncio.create_task(dispatcher.acquire(waiting))
        await asyncio.sleep(0)
        time.sleep(0.05)  # noqa: ASYNC251 - the loop must be busy: timer and release both due
        dispatcher.release(held.id, Outcome.SUCCESS)
        result = (await asyncio.gather(waiter, return_exceptions=True))[0]
        if result == "a":
            dispatcher.release(waiting.id, Outcome.SUCCESS)
            assert rejections(dispatcher, "deadline") == 0
        else:
            assert isinstance(result, errors.QueueTimeout), result
            assert rejections(dispatcher, "deadline") == 1
        assert dispatcher.snapshot().inflight == 0

    run(loop_name, scenario)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_cancelled_while_queued_leaves_the_queue(loop_name: str) -> None:
    """A client that leaves while queued takes its ticket out of the queue at once."""

    async def scenario() -> None:
        dispatcher = one_slot()
        held = dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60)
        await dispatcher.acquire(held)
        waiter = asyncio.create_task(
            dispatcher.acquire(dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60))
        )
        await asyncio.sleep(0.01)
        assert dispatcher.snapshot().queues[Lane.SHORT] == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert dispatcher.snapshot().queues[Lane.SHORT] == 0
        dispatcher.release(held.id, Outcome.SUCCESS)
        assert dispatcher.snapshot().inflight == 0

    run(loop_name, scenario)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_cancelled_in_the_pass_it_is_placed_hands_the_place_back(loop_name: str) -> None:
    """Placed and cancelled in one loop pass: the place goes back, the next waiter gets it."""

    async def scenario() -> None:
        dispatcher = one_slot()
        held = dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60)
        await dispatcher.acquire(held)
        first = asyncio.create_task(
            dispatcher.acquire(dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60))
        )
        later = dispatcher.new_ticket(Lane.SHORT, dispatcher.clock() + 60)
        second = asyncio.create_task(dispatcher.acquire(later))
        await asyncio.sleep(0.01)
        dispatcher.release(held.id, Outcome.SUCCESS)  # `first` is placed...
        first.cancel()  # ...and its client leaves before it runs
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await asyncio.wait_for(second, 1.0) == "a"
        assert dispatcher.snapshot().inflight == 1
        dispatcher.release(later.id, Outcome.SUCCESS)
        assert dispatcher.snapshot().inflight == 0

    run(loop_name, scenario)


STAGGER = 0.05


async def test_processes_hearing_one_push_do_not_all_fill_the_room_it_freed() -> None:
    """Two processes wait for the slot a third holds; its push frees it: with the drain
    staggered, one takes it and the other, told by the first one's push, keeps waiting."""
    third = {"a": PeerLoad(inflight=1)}
    one, two = one_slot(), one_slot()

    def heard_from(other: Dispatcher) -> SharedView:
        """The view of a process whose peers are `other` and the third."""
        shares = [other.scheduler.share(other.clock()), LocalShare(third, {}, {})]
        return combine([decode(encode(share, 0, 0)) for share in shares])

    two.rng = random.Random(1)  # processes draw their own delays
    one.apply_shared(heard_from(two))
    two.apply_shared(heard_from(one))

    def push(sender: Dispatcher, to: Dispatcher) -> None:
        """`sender`'s push reaches `to` 2 ms later (a Redis hop), applied staggered."""
        loop = asyncio.get_running_loop()
        view = heard_from(sender)
        loop.call_later(0.002, lambda: to.apply_shared(view, stagger=STAGGER))

    one.on_change = lambda: push(one, two)
    two.on_change = lambda: push(two, one)
    waits = [
        asyncio.create_task(d.acquire(d.new_ticket(Lane.SHORT, time.monotonic() + 60)))
        for d in (one, two)
    ]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waits)  # both queued behind the third's request
    third["a"] = PeerLoad()  # the third's push: its slot is free
    to_one, to_two = heard_from(two), heard_from(one)  # both hear it in the same instant
    one.apply_shared(to_one, stagger=STAGGER)
    two.apply_shared(to_two, stagger=STAGGER)
    await asyncio.sleep(0.2)
    assert sum(w.done() for w in waits) == 1, "both placed a request on the one free slot"
    for w in waits:
        w.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
