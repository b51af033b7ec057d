"""Example tests of where the pure scheduler places a request: strategies, lanes, retries,
load scores and the per-instance accounting they read. Plain calls with an explicit clock and
seeded rng."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from _sched_helpers import FAR, assigned_to, bring_up, make, tk

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
    Ticket,
    UnknownTicket,
    score_all,
)

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
    scores = score_all(sched.instances.states, 101.0, sched.limits.metrics_stale_after)
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
    at_edge = score_all(sched.instances.states, 30.0, 30.0)
    assert at_edge["a"].fresh
    assert at_edge["a"].others == 15
    stale = score_all(sched.instances.states, 30.5, 30.0)
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
    score = score_all(sched.instances.states, 0.0, 30.0)["a"]
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


def test_an_empty_fleet_refuses_every_request_until_an_instance_comes() -> None:
    """Discovery may find no instance yet: the scheduler holds none, refuses at once, and
    an apply that brings one serves."""
    rng = random.Random(0)
    sched = make()
    assert isinstance(sched.submit(tk(1), 0.0, rng), Rejected)
    assert sched.snapshot(0.0).instances == ()
    sched.apply([InstanceSpec("a")], sched.limits, sched.instances.health_policy, 0.0, rng)
    bring_up(sched, rng)
    assert assigned_to(sched.submit(tk(2), 0.0, rng)) == "a"


def test_reprs_show_counts() -> None:
    """Scheduler, Instances and InstanceState reprs show in-flight and queue counts."""
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
    assert repr(sched.instances) == "<Instances a=up/1>"
    state = repr(sched.state("a"))
    assert "<Instance a up" in state
    assert "inflight=1" in state
    assert "long=1" in state
    assert "failures=0" in state


# ------------------------------------------------------------------ gaps mutmut found


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
    assert [e for _, e in sched.state("a").recent_errors] == ["status 502"]


def test_least_busy_available_is_the_up_instance_with_fewest_of_ours_for_the_model() -> None:
    """The instance a token count goes to: up, serving the model, fewest of our requests."""
    rng = random.Random(0)
    x, m = frozenset({"x"}), frozenset({"m"})
    specs = InstanceSpec("a", models=x), InstanceSpec("b", models=x), InstanceSpec("c", models=m)
    sched = make(*specs, policy=HealthPolicy(fall=1))
    assert sched.least_busy_available(0.0) is None  # none probed yet
    bring_up(sched, rng)
    assert sched.least_busy_available(0.0) == "a"  # a tie: the first listed
    sched.submit(tk(1, exclude={"b", "c"}), 0.0, rng)
    assert sched.least_busy_available(0.0) == "b"
    assert sched.least_busy_available(0.0, "m") == "c"
    sched.probe("c", False, 1.0, rng)
    assert sched.least_busy_available(1.0, "m") is None
