"""Example tests of the pure scheduler: plain calls with an explicit clock and seeded rng."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

import pytest

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    HealthPolicy,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    Queued,
    Rejected,
    Scheduler,
    Ticket,
    UnknownTicket,
    score_all,
)

FAR = 1e9  # a deadline no test reaches


def make(
    *specs: InstanceSpec | str,
    strategy: str = "least_busy",
    limits: Limits | None = None,
    policy: HealthPolicy | None = None,
) -> Scheduler:
    """A scheduler over `specs` (a bare name means a default spec); instances not yet probed."""
    limits = limits or Limits()
    return Scheduler(
        [s if isinstance(s, InstanceSpec) else InstanceSpec(s) for s in specs],
        STRATEGIES[strategy](limits.metrics_stale_after),
        limits,
        policy or HealthPolicy(),
    )


def bring_up(sched: Scheduler, rng: random.Random, now: float = 0.0) -> None:
    """Probe every instance good once: the first probe decides at once."""
    for state in sched.states:
        sched.probe(state.name, True, now, rng)


def tk(
    i: int, lane: Lane = Lane.SHORT, deadline: float = FAR, exclude: Iterable[str] = ()
) -> Ticket:
    return Ticket(i, lane, deadline, frozenset(exclude))


def assigned_to(decision: object) -> str:
    assert isinstance(decision, Assigned), decision
    return decision.instance


# ------------------------------------------------------------------ least_busy


@pytest.mark.parametrize("seed", range(20))
def test_least_busy_prefers_fewer_inflight(seed: int) -> None:
    """least_busy sends a request to the instance with fewer of our requests in flight."""
    rng = random.Random(seed)
    sched = make("a", "b")
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    assert assigned_to(sched.submit(tk(2), 0.0, rng)) == "b"
    first = assigned_to(sched.submit(tk(3), 0.0, rng))
    assert assigned_to(sched.submit(tk(4), 0.0, rng)) == ({"a", "b"} - {first}).pop()


def test_least_busy_spreads_ties_at_random() -> None:
    """Equal idle instances share assignments at random, none below 20% or above 47%."""
    rng = random.Random(1234)
    sched = make("a", "b", "c")
    bring_up(sched, rng)
    counts: Counter[str] = Counter()
    for i in range(300):
        counts[assigned_to(sched.submit(tk(i), 0.0, rng))] += 1
        sched.release(i, Outcome.SUCCESS, 0.0, rng)
    assert set(counts) == {"a", "b", "c"}
    for name, n in counts.items():
        assert 60 <= n <= 141, (name, counts)


# ------------------------------------------------------------------ round_robin


def test_round_robin_cycles_in_order() -> None:
    """round_robin hands requests to instances in fleet order, again and again."""
    rng = random.Random(0)
    sched = make("a", "b", "c", strategy="round_robin")
    bring_up(sched, rng)
    names = [assigned_to(sched.submit(tk(i), 0.0, rng)) for i in range(7)]
    assert names == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_a_full_instance() -> None:
    """round_robin passes over an instance with no room and keeps the cycle going."""
    rng = random.Random(0)
    specs = [InstanceSpec(n, slots=1) for n in "abc"]
    sched = make(*specs, strategy="round_robin", limits=Limits(max_queue_per_instance=0))
    bring_up(sched, rng)
    assert [assigned_to(sched.submit(tk(i), 0.0, rng)) for i in (1, 2, 3)] == ["a", "b", "c"]
    sched.release(1, Outcome.SUCCESS, 0.0, rng)
    sched.release(3, Outcome.SUCCESS, 0.0, rng)
    assert assigned_to(sched.submit(tk(4), 0.0, rng)) == "a"
    assert assigned_to(sched.submit(tk(5), 0.0, rng)) == "c"  # b is full


def test_round_robin_skips_a_down_instance() -> None:
    """round_robin passes over an instance its probes took down."""
    rng = random.Random(0)
    sched = make("a", "b", "c", strategy="round_robin", policy=HealthPolicy(fall=1))
    bring_up(sched, rng)
    sched.probe("b", False, 0.0, rng)
    names = [assigned_to(sched.submit(tk(i), 0.0, rng)) for i in range(4)]
    assert names == ["a", "c", "a", "c"]
    assert "next=" in repr(sched.strategy)


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
    assert sched.queue_length(Lane.SHORT) == 2


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
    assert sched.inflight == 2


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
    assert sched.inflight == 0


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
    assert [t.id for t in sched.queued_tickets()] == [5]


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
    assert sched.queue_length(Lane.SHORT) == 2
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


# ------------------------------------------------------------------ lanes


def test_short_lane_instance_never_takes_long_requests() -> None:
    """Long requests go only to instances serving the long lane, and wait rather than spill."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("s", lane="short", slots=4),
        InstanceSpec("l", lane="long", slots=1),
        limits=Limits(max_queue_per_instance=1),
    )
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, Lane.LONG), 0.0, rng)) == "l"
    assert assigned_to(sched.submit(tk(2, Lane.LONG), 0.0, rng)) == "l"
    assert isinstance(sched.submit(tk(3, Lane.LONG), 0.0, rng), Queued)
    assert sched.state("s").inflight == 0
    for i in range(4, 9):  # slots 4 + max_queue 1
        assert assigned_to(sched.submit(tk(i), 0.0, rng)) == "s"
    assert sched.state("s").long_prefilling == 0


def test_lane_without_instances_falls_back_to_all() -> None:
    """A lane no instance serves may use any instance rather than fail."""
    rng = random.Random(0)
    sched = make(InstanceSpec("s", lane="short"))
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, Lane.LONG), 0.0, rng)) == "s"


def test_shared_instance_limits_long_prefills_but_not_short() -> None:
    """With max_long_per_instance=1 a second long request waits while short ones still run."""
    rng = random.Random(0)
    sched = make("a", limits=Limits(max_long_per_instance=1))
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, Lane.LONG), 0.0, rng)) == "a"
    assert sched.submit(tk(2, Lane.LONG), 0.0, rng) == Queued(tk(2, Lane.LONG), 1, FAR)
    assert assigned_to(sched.submit(tk(3), 0.0, rng)) == "a"
    assert sched.state("a").long_prefilling == 1
    assert sched.prefill_done(3, 0.0, rng) == []  # a short request holds no prefill place
    assert sched.prefill_done(1, 0.0, rng) == [Assigned(tk(2, Lane.LONG), "a")]
    assert sched.prefill_done(1, 0.0, rng) == []  # once only
    assert sched.state("a").long_prefilling == 1
    assert sched.state("a").inflight == 3


def test_release_during_prefill_frees_the_long_place() -> None:
    """A long request released before its first token gives its prefill place back."""
    rng = random.Random(0)
    sched = make("a", limits=Limits(max_long_per_instance=1))
    bring_up(sched, rng)
    sched.submit(tk(1, Lane.LONG), 0.0, rng)
    sched.submit(tk(2, Lane.LONG), 0.0, rng)
    assert sched.release(1, Outcome.NEUTRAL, 0.0, rng) == [Assigned(tk(2, Lane.LONG), "a")]
    assert sched.state("a").long_prefilling == 1
    sched.release(2, Outcome.SUCCESS, 0.0, rng)
    assert sched.state("a").long_prefilling == 0


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
    assert sched.queue_length(Lane.SHORT) == sched.queue_length(Lane.LONG) == 0
    assert sched.holder(1) == "a"  # the request already there is the shell's to finish


def test_expired_deadline_is_rejected_at_submit() -> None:
    """A ticket whose deadline is not after `now` is rejected with deadline."""
    rng = random.Random(0)
    sched = make("a")
    bring_up(sched, rng)
    decision = sched.submit(tk(1, deadline=5.0), 5.0, rng)
    assert isinstance(decision, Rejected)
    assert decision.reason == "deadline"
    assert sched.inflight == 0


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
    assert sched.inflight == 0


# ------------------------------------------------------------------ retries


@pytest.mark.parametrize("seed", range(20))
def test_retry_prefers_an_untried_instance(seed: int) -> None:
    """A retry excluding "a" goes to "b" when b has room."""
    rng = random.Random(seed)
    sched = make("a", "b")
    bring_up(sched, rng)
    sched.submit(tk(1, exclude={"a"}), 0.0, rng)  # b now looks busier than a
    assert assigned_to(sched.submit(tk(2, exclude={"a"}), 0.0, rng)) == "b"


def test_retry_never_returns_to_a_tried_instance() -> None:
    """A retry is turned away rather than go back to an instance it tried; the shell can tell."""
    rng = random.Random(0)
    sched = make("a")
    bring_up(sched, rng)
    assert not sched.untried_available(Lane.SHORT, frozenset({"a"}), 0.0)
    decision = sched.submit(tk(1, exclude={"a"}), 0.0, rng)
    assert isinstance(decision, Rejected)
    assert decision.reason == "no_instance"
    assert sched.state("a").inflight == 0


def test_untried_available_ignores_unavailable_instances() -> None:
    """untried_available is true only while an untried instance of the lane is available."""
    rng = random.Random(0)
    sched = make("a", InstanceSpec("b", lane="long"), policy=HealthPolicy(fall=1))
    bring_up(sched, rng)
    assert sched.untried_available(Lane.LONG, frozenset({"a"}), 0.0)
    assert not sched.untried_available(Lane.SHORT, frozenset({"a"}), 0.0)  # b is long-only
    sched.probe("b", False, 0.0, rng)
    assert not sched.untried_available(Lane.LONG, frozenset({"a"}), 0.0)


def test_busy_instance_is_a_last_resort() -> None:
    """After a BUSY answer an instance is avoided while another has room, until the penalty ends."""
    rng = random.Random(0)
    sched = make("a", "b", policy=HealthPolicy(busy_penalty=2.0))
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    sched.release(1, Outcome.BUSY, 10.0, rng)
    assert sched.state("a").busy_until == 12.0
    assert sched.state("a").available(10.0)
    assert sched.state("a").consecutive_failures == 0
    for i in range(2, 8):
        assert assigned_to(sched.submit(tk(i), 11.0, rng)) == "b"
    # b now holds 6 and a none: once the penalty is over, least_busy picks a again.
    assert assigned_to(sched.submit(tk(8), 12.0, rng)) == "a"


def test_busy_instance_still_serves_when_nothing_else_has_room() -> None:
    """A busy instance takes the request when it is the only one with room."""
    rng = random.Random(0)
    sched = make(
        InstanceSpec("a", slots=1),
        InstanceSpec("b", slots=1),
        limits=Limits(max_queue_per_instance=0),
    )
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"b"}), 0.0, rng)) == "a"
    sched.release(1, Outcome.BUSY, 0.0, rng)
    assert assigned_to(sched.submit(tk(2), 0.1, rng)) == "b"
    assert assigned_to(sched.submit(tk(3), 0.2, rng)) == "a"


def test_untried_busy_instance_beats_a_tried_one() -> None:
    """A retry goes to an untried busy instance before the one it already tried."""
    rng = random.Random(0)
    sched = make("a", "b")
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(1, exclude={"a"}), 0.0, rng)) == "b"
    sched.release(1, Outcome.BUSY, 0.0, rng)
    assert assigned_to(sched.submit(tk(2, exclude={"a"}), 0.5, rng)) == "b"


# ------------------------------------------------------------------ load scores


def test_unknown_load_is_not_idle() -> None:
    """An instance without a report scores the worst fresh `others`, never as the emptiest."""
    rng = random.Random(0)
    sched = make("a", "b")
    bring_up(sched, rng)
    sched.report_load("a", LoadReport(running=10, waiting=5, kv_usage=0.4, at=100.0))
    scores = score_all(sched.states, 101.0, sched.limits.metrics_stale_after)
    assert scores["a"].fresh
    assert scores["a"].others == 15
    assert not scores["b"].fresh
    assert scores["b"].others == scores["a"].others
    assert scores["b"].kv == scores["a"].kv == 0.4
    assert scores["b"].total >= scores["a"].total


def test_unknown_load_does_not_win_against_a_lighter_fresh_one() -> None:
    """A measured light instance beats an unmeasured one, whatever the random tie-break."""
    for seed in range(20):
        rng = random.Random(seed)
        sched = make("heavy", "light", "unknown")
        bring_up(sched, rng)
        sched.report_load("heavy", LoadReport(running=10, waiting=5, kv_usage=None, at=0.0))
        sched.report_load("light", LoadReport(running=1, waiting=0, kv_usage=None, at=0.0))
        assert assigned_to(sched.submit(tk(1), 1.0, rng)) == "light"


def test_stale_report_counts_as_unknown() -> None:
    """A report older than metrics_stale_after no longer counts as a measurement."""
    rng = random.Random(0)
    sched = make("a", "b", limits=Limits(metrics_stale_after=30.0))
    bring_up(sched, rng)
    sched.report_load("a", LoadReport(running=10, waiting=5, kv_usage=0.5, at=0.0))
    sched.report_load("b", LoadReport(running=2, waiting=0, kv_usage=0.1, at=25.0))
    at_edge = score_all(sched.states, 30.0, 30.0)
    assert at_edge["a"].fresh
    assert at_edge["a"].others == 15
    stale = score_all(sched.states, 30.5, 30.0)
    assert not stale["a"].fresh
    # Unknown borrows the worst fresh report in the fleet: here b's.
    assert stale["a"].others == stale["b"].others == 2
    assert stale["a"].kv == 0.1


def test_others_traffic_subtracts_our_own_requests() -> None:
    """A report of 3 running taken while we had 3 in flight shows no foreign traffic."""
    rng = random.Random(0)
    sched = make("a")
    bring_up(sched, rng)
    for i in range(3):
        sched.submit(tk(i), 0.0, rng)
    sched.report_load("a", LoadReport(running=3, waiting=0, kv_usage=None, at=0.0))
    assert sched.state("a").inflight_at_report == 3
    score = score_all(sched.states, 0.0, 30.0)["a"]
    assert score.others == 0
    assert score.own == 3
    assert score.kv == 0.0


# ------------------------------------------------------------------ errors and repr


def test_release_of_unknown_ticket_raises() -> None:
    """Releasing a ticket that is not held, or releasing twice, raises UnknownTicket."""
    rng = random.Random(0)
    sched = make("a")
    bring_up(sched, rng)
    with pytest.raises(UnknownTicket):
        sched.release(99, Outcome.SUCCESS, 0.0, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.release(1, Outcome.SUCCESS, 0.0, rng)
    with pytest.raises(UnknownTicket):
        sched.release(1, Outcome.SUCCESS, 0.0, rng)


def test_scheduler_needs_an_instance() -> None:
    """A scheduler over an empty fleet is refused at construction."""
    with pytest.raises(ValueError, match="at least one instance"):
        make()


def test_reprs_show_counts() -> None:
    """Scheduler and InstanceState reprs show in-flight and queue counts."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), limits=Limits(max_queue_per_instance=0))
    assert "unknown" in repr(sched.state("a"))
    bring_up(sched, rng)
    sched.submit(tk(1, Lane.LONG), 0.0, rng)
    sched.submit(tk(2), 0.0, rng)
    text = repr(sched)
    assert "least_busy" in text
    assert "inflight=1" in text
    assert "short=1" in text
    assert "long=0" in text
    state = repr(sched.state("a"))
    assert "<Instance a up" in state
    assert "inflight=1" in state
    assert "long=1" in state
    assert "failures=0" in state


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
    assert sched.queue_length(Lane.SHORT) == 1
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
    assert sched.queue_length(Lane.SHORT) == 0


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


def test_prefill_work_ahead_is_counted_and_teaches_the_prefill_rate() -> None:
    """Prompt tokens add up while in prefill; each first token teaches (ahead + own) / ttft."""
    rng = random.Random(0)
    sched = make("a")
    bring_up(sched, rng)
    first = Ticket(1, Lane.SHORT, FAR, tokens=1000)
    second = Ticket(2, Lane.SHORT, FAR, tokens=3000)
    sched.submit(first, 0.0, rng)
    sched.submit(second, 0.0, rng)
    state = sched.state("a")
    assert state.pending_prefill_tokens == 4000
    assert state.assigned_total == 2
    sched.prefill_done(1, 0.0, rng, ttft=1.0)  # 1000 tokens in 1 s
    assert state.pending_prefill_tokens == 3000
    assert state.speed.prefill.value == pytest.approx(1000.0)
    # The second waited behind the first's 1000: 4000 tokens in 4 s is the same rate.
    sched.prefill_done(2, 0.0, rng, ttft=4.0)
    assert state.pending_prefill_tokens == 0
    assert state.speed.prefill.value == pytest.approx(1000.0)
    sched.release(1, Outcome.SUCCESS, 0.0, rng)
    sched.release(2, Outcome.SUCCESS, 0.0, rng)
    assert (state.inflight, state.pending_prefill_tokens, state.assigned_total) == (0, 0, 2)


def test_queue_depth_is_ours_beyond_the_slots_or_what_the_instance_reports() -> None:
    """An instance's queue depth is our requests beyond its slots, or its reported waiting
    count when that is larger."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=2))
    bring_up(sched, rng)
    state = sched.state("a")
    assert state.queue_depth() == 0
    for i in range(5):
        sched.submit(tk(i), 0.0, rng)
    assert state.queue_depth() == 3
    assert state.queue_depth(LoadReport(running=2, waiting=1, kv_usage=None, at=0.0)) == 3
    assert state.queue_depth(LoadReport(running=2, waiting=7, kv_usage=None, at=0.0)) == 7


def test_release_records_the_error_on_the_instance() -> None:
    """The error text a failed release names is kept in the instance's recent errors."""
    rng = random.Random(0)
    sched = make("a", policy=HealthPolicy(eject_after_failures=100))
    bring_up(sched, rng)
    sched.submit(tk(1), 0.0, rng)
    sched.release(1, Outcome.FAILURE, 0.0, rng, error="status 502")
    assert sched.state("a").recent_errors == ["status 502"]


def test_rejections_on_drain_and_close_carry_the_retry_delay() -> None:
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
