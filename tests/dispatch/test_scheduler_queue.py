"""Example tests of when the pure scheduler makes a request wait or turns it away: limits,
FIFO drain, cancel, deadlines, no instance, close, and the rejections they carry. Plain calls
with an explicit clock and seeded rng."""

from __future__ import annotations

import random

from _sched_helpers import (
    FAR,
    assigned_to,
    bring_up,
    holder,
    inflight_of,
    make,
    queue_length_of,
    queued_tickets,
    tk,
)

from gateway.dispatch import (
    Assigned,
    HealthPolicy,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    Queued,
    Rejected,
)

# ------------------------------------------------------------------ per-instance and gateway limits


def test_single_instance_holds_slots_plus_queue_then_gateway_queues() -> None:
    """With slots=2 and max_queue_per_instance=1 an instance takes 3 requests; the 4th waits."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=2), limits=Limits(max_queue_per_instance=1))
    bring_up(sched, rng)
    for i in (1, 2, 3):
        assert assigned_to(sched.submit(tk(i), 0.0, rng)) == "a"
    assert sched.state("a").queue_depth() == 1
    assert sched.submit(tk(4), 0.0, rng) == Queued(tk(4), 1, FAR)


def test_overflow_goes_to_the_other_instance() -> None:
    """A request that would exceed one instance's limit goes to another, even a busier one."""
    rng = random.Random(0)
    specs = [InstanceSpec(n, slots=2) for n in "ab"]
    sched = make(*specs, limits=Limits(max_queue_per_instance=1))
    bring_up(sched, rng)
    # b reports heavy foreign traffic, so a is preferred while it has room.
    sched.report_load("a", LoadReport(running=0, waiting=0, kv_usage=None, at=0.0))
    sched.report_load("b", LoadReport(running=50, waiting=50, kv_usage=None, at=0.0))
    for i in (1, 2, 3):
        assert assigned_to(sched.submit(tk(i), 0.0, rng)) == "a"
    assert assigned_to(sched.submit(tk(4), 0.0, rng)) == "b"
    assert sched.state("a").inflight == 3


def test_gateway_queue_is_bounded() -> None:
    """Past gateway_queue_size waiting requests, the next is rejected with a retry delay."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        limits=Limits(max_queue_per_instance=0, gateway_queue_size=2, queue_retry_after=2.5),
    )
    bring_up(sched, rng)
    assert isinstance(sched.submit(tk(1), 0.0, rng), Assigned)
    assert sched.submit(tk(2), 0.0, rng) == Queued(tk(2), 1, FAR)
    assert sched.submit(tk(3), 0.0, rng) == Queued(tk(3), 2, FAR)
    rejected = sched.submit(tk(4), 0.0, rng)
    assert isinstance(rejected, Rejected)
    assert rejected.reason == "queue_full"
    assert rejected.retry_after > 0
    assert queue_length_of(sched, Lane.SHORT) == 2


def test_global_limit_queues_although_instances_have_room() -> None:
    """With global_limit=2 the third request waits even though instances have slots free."""
    rng = random.Random(0)
    sched = make("a", "b", limits=Limits(global_limit=2))
    bring_up(sched, rng)
    assert isinstance(sched.submit(tk(1), 0.0, rng), Assigned)
    assert isinstance(sched.submit(tk(2), 0.0, rng), Assigned)
    assert sched.submit(tk(3), 0.0, rng) == Queued(tk(3), 1, FAR)
    out = sched.release(1, Outcome.SUCCESS, 0.0, rng)
    assert [type(d) for d in out] == [Assigned]
    assert out[0].ticket == tk(3)
    assert inflight_of(sched) == 2


# ------------------------------------------------------------------ queue: FIFO, cancel


def test_release_drains_the_queue_in_arrival_order() -> None:
    """Each release hands the freed place to the oldest waiting request."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    assert isinstance(sched.submit(tk(1), 0.0, rng), Assigned)
    for i in (2, 3, 4):
        assert isinstance(sched.submit(tk(i), 0.0, rng), Queued)
    order = []
    for i in (1, 2, 3, 4):
        out = sched.release(i, Outcome.SUCCESS, 0.0, rng)
        order += [d.ticket.id for d in out if isinstance(d, Assigned)]
    assert order == [2, 3, 4]
    assert inflight_of(sched) == 0


def test_one_event_can_place_several_queued_requests_in_order() -> None:
    """When an instance comes up, the decisions for waiting requests come back oldest first."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        InstanceSpec("b", slots=3),
        limits=Limits(max_queue_per_instance=0),
    )
    sched.probe("a", True, 0.0, rng)
    assert isinstance(sched.submit(tk(1), 0.0, rng), Assigned)
    for i in (2, 3, 4, 5):
        assert isinstance(sched.submit(tk(i), 0.0, rng), Queued)
    out = sched.probe("b", True, 0.0, rng)
    assert out == [Assigned(tk(2), "b"), Assigned(tk(3), "b"), Assigned(tk(4), "b")]
    assert [t.id for t in queued_tickets(sched)] == [5]


def test_cancel_removes_a_queued_ticket() -> None:
    """A cancelled ticket leaves the queue and is skipped when places free up."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    for i in (2, 3, 4):
        sched.submit(tk(i), 0.0, rng)
    assert sched.cancel(3) is True
    assert sched.cancel(3) is False
    assert sched.cancel(1) is False  # held, not queued: cancel does not touch it
    assert queue_length_of(sched, Lane.SHORT) == 2
    assert sched.release(1, Outcome.SUCCESS, 0.0, rng) == [Assigned(tk(2), "a")]
    assert sched.release(2, Outcome.SUCCESS, 0.0, rng) == [Assigned(tk(4), "a")]


def test_a_new_request_does_not_overtake_its_lane_queue() -> None:
    """A request arriving while its lane has waiters queues behind them."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.submit(tk(2), 0.0, rng)
    assert sched.submit(tk(3), 0.0, rng) == Queued(tk(3), 2, FAR)


def test_a_new_request_queues_behind_a_waiter_although_an_instance_has_room() -> None:
    """When room appears with no event to drain the queue (an ejection ran out), a new
    request still queues behind the waiter, and the next event serves the waiter first."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        InstanceSpec("b", slots=1),
        limits=Limits(max_queue_per_instance=0),
        policy=HealthPolicy(eject_after_failures=1, ejection_base=10.0),
    )
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    sched.release(1, Outcome.FAILURE, 0.0, rng)  # a is ejected until t=10
    assert assigned_to(sched.submit(tk(2), 1.0, rng)) == "b"
    assert sched.submit(tk(3), 1.0, rng) == Queued(tk(3), 1, FAR)
    # At t=11 a has room again, but no probe or release has come to drain the queue.
    assert sched.state("a").available(11.0)
    assert sched.submit(tk(4), 11.0, rng) == Queued(tk(4), 2, FAR)
    assert sched.state("a").inflight == 0
    assert sched.probe("a", True, 11.0, rng) == [Assigned(tk(3), "a")]
    assert sched.release(2, Outcome.SUCCESS, 12.0, rng) == [Assigned(tk(4), "b")]


def test_expired_ejection_drains_the_queue_on_the_next_probe() -> None:
    """Once an ejection expires, the next probe places waiting requests on that instance."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        InstanceSpec("b", slots=1),
        limits=Limits(max_queue_per_instance=0),
        policy=HealthPolicy(eject_after_failures=1, ejection_base=10.0),
    )
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    sched.release(1, Outcome.FAILURE, 0.0, rng)
    assert sched.state("a").ejected_until == 10.0
    assert assigned_to(sched.submit(tk(2), 1.0, rng)) == "b"
    assert isinstance(sched.submit(tk(3), 1.0, rng), Queued)
    # a is available again from t=10; b still holds its long request. The shell's periodic
    # probe of a is the only event that comes.
    assert sched.state("a").available(11.0)
    assert sched.probe("a", True, 11.0, rng) == [Assigned(tk(3), "a")]


def test_a_wait_that_runs_out_where_room_came_back_unannounced_starts_there() -> None:
    """A request whose queue wait (not its deadline) runs out after an ejection ended, with
    no probe since, is placed on that instance rather than refused; past its deadline it
    is refused."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        InstanceSpec("b", slots=1),
        limits=Limits(max_queue_per_instance=0, max_queue_wait_short=15.0),
        policy=HealthPolicy(eject_after_failures=1, ejection_base=10.0),
    )
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    sched.release(1, Outcome.FAILURE, 0.0, rng)
    assert assigned_to(sched.submit(tk(2), 1.0, rng)) == "b"
    waiting = sched.submit(tk(3), 1.0, rng)
    assert waiting == Queued(tk(3), 1, 16.0)
    assert isinstance(sched.submit(tk(4, deadline=12.0), 1.0, rng), Queued)
    assert sched.expire(3, 16.0, rng) == [Assigned(tk(3), "a")]
    (refused,) = sched.expire(4, 16.0, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "deadline"


# ------------------------------------------------------------------ no instance, deadline, close


def test_no_available_instance_rejects() -> None:
    """Before any probe, or with every instance down, a request is rejected with no_instance."""
    rng = random.Random(0)
    sched = make("a", "b")
    decision = sched.submit(tk(1), 0.0, rng)
    assert isinstance(decision, Rejected)
    assert decision.reason == "no_instance"
    sched.probe("a", False, 0.0, rng)
    sched.probe("b", False, 0.0, rng)
    decision = sched.submit(tk(2), 0.0, rng)
    assert isinstance(decision, Rejected)
    assert decision.reason == "no_instance"
    assert decision.retry_after > 0


def test_last_instance_going_down_rejects_the_queue() -> None:
    """When the last instance fails `fall` probes, every waiting request is rejected."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        limits=Limits(max_queue_per_instance=0),
        policy=HealthPolicy(fall=2),
    )
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.submit(tk(2), 0.0, rng)
    sched.submit(tk(3, Lane.LONG), 0.0, rng)
    assert sched.probe("a", False, 1.0, rng) == []
    out = sched.probe("a", False, 2.0, rng)
    assert sorted((d.ticket.id, type(d).__name__, getattr(d, "reason", "")) for d in out) == [
        (2, "Rejected", "no_instance"),
        (3, "Rejected", "no_instance"),
    ]
    assert queue_length_of(sched, Lane.SHORT) == queue_length_of(sched, Lane.LONG) == 0
    assert holder(sched, 1) == "a"  # the request already there is the shell's to finish


def test_expired_deadline_is_rejected_at_submit() -> None:
    """A ticket whose deadline is not after `now` is rejected with deadline."""
    rng = random.Random(0)
    sched = make("a")
    bring_up(sched, rng)
    decision = sched.submit(tk(1, deadline=5.0), 5.0, rng)
    assert isinstance(decision, Rejected)
    assert decision.reason == "deadline"
    assert inflight_of(sched) == 0


def test_queued_ticket_past_deadline_is_rejected_on_drain() -> None:
    """A waiting ticket whose deadline passed is rejected, not assigned, when a place frees."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.submit(tk(2, deadline=5.0), 0.0, rng)
    sched.submit(tk(3, deadline=100.0), 0.0, rng)
    out = sched.release(1, Outcome.SUCCESS, 10.0, rng)
    assert out == [
        Rejected(tk(2, deadline=5.0), "deadline", sched.limits.queue_retry_after),
        Assigned(tk(3, deadline=100.0), "a"),
    ]


def test_close_rejects_queued_and_later_requests() -> None:
    """close() turns away every waiting request and every later one with shutting_down."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.submit(tk(2), 0.0, rng)
    sched.submit(tk(3, Lane.LONG), 0.0, rng)
    out = sched.close()
    assert {d.ticket.id for d in out} == {2, 3}
    assert all(isinstance(d, Rejected) and d.reason == "shutting_down" for d in out)
    later = sched.submit(tk(4), 0.0, rng)
    assert isinstance(later, Rejected)
    assert later.reason == "shutting_down"
    assert sched.release(1, Outcome.SUCCESS, 0.0, rng) == []
    assert inflight_of(sched) == 0


# ------------------------------------------------------------------ known defects


def test_queued_retry_does_not_block_its_lane() -> None:
    """A retry waiting for an untried instance does not hold up requests an idle one could run."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        InstanceSpec("b", slots=1),
        limits=Limits(max_queue_per_instance=0),
    )
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"a"}), 0.0, rng)) == "b"
    # A retry of a request that failed on a: only b will do, and b is full, so it waits
    # apart from the lane's FIFO...
    assert isinstance(sched.submit(tk(2, exclude={"a"}), 0.0, rng), Queued)
    assert queue_length_of(sched, Lane.SHORT) == 1
    assert sched.state("a").inflight == 0
    # ...and a fresh request still goes to the idle instance.
    assert assigned_to(sched.submit(tk(3), 0.0, rng)) == "a"
    # When b frees its slot, the waiting retry takes it.
    decisions = sched.release(1, Outcome.SUCCESS, 0.0, rng)
    assert [assigned_to(d) for d in decisions] == ["b"]
    assert decisions[0].ticket.id == 2


# ------------------------------------------------------------------ gaps mutmut found


def test_queued_retry_is_rejected_when_its_last_untried_instance_goes_down() -> None:
    """A retry waiting for b alone is turned away with no_instance once b's probes fail."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        InstanceSpec("b", slots=1),
        limits=Limits(max_queue_per_instance=0, queue_retry_after=2.5),
        policy=HealthPolicy(fall=1),
    )
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"a"}), 0.0, rng)) == "b"
    assert isinstance(sched.submit(tk(2, exclude={"a"}), 0.0, rng), Queued)
    assert sched.probe("b", False, 1.0, rng) == [Rejected(tk(2, exclude={"a"}), "no_instance", 2.5)]
    assert queue_length_of(sched, Lane.SHORT) == 0


def test_a_waiter_whose_deadline_is_now_is_rejected_not_placed() -> None:
    """A queued ticket whose deadline equals the drain's `now` has run out of time."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.submit(tk(2, deadline=5.0), 0.0, rng)
    assert sched.release(1, Outcome.SUCCESS, 5.0, rng) == [
        Rejected(tk(2, deadline=5.0), "deadline", sched.limits.queue_retry_after)
    ]


def test_rejections_at_submit_carry_the_ticket_and_retry_delay() -> None:
    """Every rejection names its ticket and the configured Retry-After delay."""
    rng = random.Random(0)
    sched = make("a", limits=Limits(queue_retry_after=2.5))
    assert sched.submit(tk(1), 0.0, rng) == Rejected(tk(1), "no_instance", 2.5)
    bring_up(sched, rng)
    assert sched.submit(tk(2, deadline=0.0), 0.0, rng) == Rejected(
        tk(2, deadline=0.0), "deadline", 2.5
    )
    sched.close()
    assert sched.submit(tk(3), 0.0, rng) == Rejected(tk(3), "shutting_down", 2.5)


def test_rejections_on_placing_and_close_carry_the_retry_delay() -> None:
    """Waiters turned away when their lane dies, or at close, get the configured delay."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        limits=Limits(max_queue_per_instance=0, queue_retry_after=2.5),
        policy=HealthPolicy(fall=1),
    )
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.submit(tk(2), 0.0, rng)
    assert sched.probe("a", False, 1.0, rng) == [Rejected(tk(2), "no_instance", 2.5)]
    sched.probe("a", True, 2.0, rng)
    sched.probe("a", True, 2.0, rng)
    assert sched.state("a").available(2.0)
    sched.release(1, Outcome.SUCCESS, 2.0, rng)
    sched.submit(tk(3), 2.0, rng)
    sched.submit(tk(4), 2.0, rng)
    assert sched.close() == [Rejected(tk(4), "shutting_down", 2.5)]
