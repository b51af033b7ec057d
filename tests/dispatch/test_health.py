"""Health verdicts: active probes with rise/fall, passive ejection with growing time."""

from __future__ import annotations

import random

import pytest

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    HealthPolicy,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    Outcome,
    Scheduler,
    Ticket,
)
from gateway.dispatch.health import apply_outcome, apply_probe, ejection_time

POLICY = HealthPolicy(rise=2, fall=3, eject_after_failures=5, ejection_base=10, ejection_max=300)


def fleet(n: int) -> list[InstanceState]:
    """`n` instances, each brought up by one good probe."""
    states = [InstanceState(InstanceSpec(f"i{k}")) for k in range(n)]
    for state in states:
        apply_probe(state, True, POLICY, 0.0)
    return states


def fail(state: InstanceState, fleet: list[InstanceState], times: int, now: float = 0.0) -> bool:
    """Record `times` FAILURE outcomes on `state`; return whether the last one ejected it."""
    ejected = False
    for _ in range(times):
        ejected = apply_outcome(state, Outcome.FAILURE, now, POLICY, fleet)
    return ejected


# ------------------------------------------------------------------ active probes


@pytest.mark.parametrize("ok", [True, False])
def test_first_probe_decides_at_once(ok: bool) -> None:
    """The first probe answer sets the verdict without waiting for rise or fall."""
    state = InstanceState(InstanceSpec("a"))
    assert state.up is None
    assert not state.available(0.0)
    assert apply_probe(state, ok, POLICY, 0.0) is True
    assert state.up is ok
    assert state.available(0.0) is ok


def test_down_instance_needs_rise_good_probes() -> None:
    """After the first verdict, `rise` good probes in a row bring an instance up."""
    state = InstanceState(InstanceSpec("a"))
    apply_probe(state, False, POLICY, 0.0)
    assert apply_probe(state, True, POLICY, 0.0) is False
    assert state.up is False
    assert apply_probe(state, False, POLICY, 0.0) is False  # the streak restarts
    assert apply_probe(state, True, POLICY, 0.0) is False
    assert apply_probe(state, True, POLICY, 0.0) is True
    assert state.up is True


def test_up_instance_needs_fall_bad_probes() -> None:
    """An up instance goes down only after `fall` bad probes in a row."""
    state = InstanceState(InstanceSpec("a"))
    apply_probe(state, True, POLICY, 0.0)
    assert [apply_probe(state, False, POLICY, 0.0) for _ in range(2)] == [False, False]
    assert state.up is True
    assert apply_probe(state, False, POLICY, 0.0) is True
    assert state.up is False


def test_one_bad_probe_does_not_flap() -> None:
    """Alternating bad and good probes never take an up instance down."""
    state = InstanceState(InstanceSpec("a"))
    apply_probe(state, True, POLICY, 0.0)
    for _ in range(20):
        assert apply_probe(state, False, POLICY, 0.0) is False
        assert apply_probe(state, True, POLICY, 0.0) is False
    assert state.up is True


def test_coming_up_clears_consecutive_failures() -> None:
    """An instance that comes back up starts with a clean failure count."""
    state = InstanceState(InstanceSpec("a"), consecutive_failures=4)
    apply_probe(state, True, POLICY, 0.0)
    assert state.consecutive_failures == 0


# ------------------------------------------------------------------ ejection time


def test_ejection_time_sequence_matches_docstring() -> None:
    """With base 10 s and max 300 s the ejections last 10, 20, 40, 80, 160, 300, 300 s."""
    times = [ejection_time(n, POLICY) for n in range(1, 8)]
    assert times == [10, 20, 40, 80, 160, 300, 300]
    assert all(isinstance(t, float) for t in times)


def test_ejection_time_is_capped_for_large_counts() -> None:
    """However many ejections in a row, the time never exceeds ejection_max."""
    assert ejection_time(1000, POLICY) == 300.0


# ------------------------------------------------------------------ passive ejection


def test_ejected_after_consecutive_failures() -> None:
    """The `eject_after_failures`-th consecutive failure ejects for the base time."""
    states = fleet(2)
    a = states[0]
    assert fail(a, states, 4) is False
    assert a.available(0.0)
    assert apply_outcome(a, Outcome.FAILURE, 5.0, POLICY, states, "boom") is True
    assert a.ejected_until == 15.0
    assert a.ejections == a.ejections_total == 1
    assert a.consecutive_failures == 0
    assert a.failures_total == 5
    assert a.recent_errors == [(5.0, "boom")]  # with when, for /admin/instances


def test_ejected_instance_returns_when_the_time_passes() -> None:
    """An ejected instance is unavailable until `now` reaches ejected_until."""
    states = fleet(2)
    a = states[0]
    fail(a, states, 5, now=100.0)
    assert not a.available(100.0)
    assert not a.available(109.999)
    assert a.available(110.0)
    assert a.up is True


def test_second_ejection_lasts_twice_as_long() -> None:
    """Ejections in a row grow along the ejection_time sequence."""
    states = fleet(2)
    a = states[0]
    fail(a, states, 5, now=0.0)
    assert a.ejected_until == 10.0
    fail(a, states, 5, now=10.0)
    assert a.ejected_until == 30.0
    assert a.ejections == 2


def test_neutral_outcomes_never_count() -> None:
    """NEUTRAL outcomes neither count toward ejection nor reset the count."""
    states = fleet(2)
    a = states[0]
    for _ in range(100):
        assert apply_outcome(a, Outcome.NEUTRAL, 0.0, POLICY, states) is False
    assert a.consecutive_failures == 0
    fail(a, states, 4)
    apply_outcome(a, Outcome.NEUTRAL, 0.0, POLICY, states)
    assert a.consecutive_failures == 4
    assert fail(a, states, 1) is True


def test_busy_outcomes_are_a_penalty_not_a_failure() -> None:
    """BUSY outcomes mark the instance busy for busy_penalty and never count toward ejection."""
    policy = HealthPolicy(eject_after_failures=2, busy_penalty=1.5)
    states = fleet(2)
    a = states[0]
    for _ in range(10):
        assert apply_outcome(a, Outcome.BUSY, 4.0, policy, states) is False
    assert a.consecutive_failures == 0
    assert a.failures_total == 0
    assert a.available(4.0)
    assert a.busy(4.0)
    assert a.busy(5.49)
    assert not a.busy(5.5)
    assert a.busy_until == 5.5


def test_success_resets_the_failure_count() -> None:
    """A SUCCESS between failures starts the count again, so no ejection."""
    states = fleet(2)
    a = states[0]
    for _ in range(10):
        assert fail(a, states, 4) is False
        assert apply_outcome(a, Outcome.SUCCESS, 0.0, POLICY, states) is False
        assert a.consecutive_failures == 0
    assert a.ejected_until is None
    assert a.failures_total == 40


def test_recent_errors_keep_the_last_five() -> None:
    """Only the five most recent errors are kept for the operator, each with its time."""
    states = fleet(2)
    a = states[0]
    for i in range(8):
        apply_outcome(
            a, Outcome.FAILURE, float(i), HealthPolicy(eject_after_failures=100), states, f"e{i}"
        )
    assert a.recent_errors == [(float(i), f"e{i}") for i in range(3, 8)]


def test_verdict_time_moves_only_when_the_verdict_changes() -> None:
    """`verdict_since` says when an instance went down (or up): a probe that confirms
    the verdict leaves it; failed probes are counted whatever they change."""
    state = InstanceState(InstanceSpec("a"))
    assert state.verdict_since is None
    apply_probe(state, True, POLICY, 1.0)
    assert state.verdict_since == 1.0
    apply_probe(state, True, POLICY, 2.0)
    assert state.verdict_since == 1.0
    for t in range(3, 3 + POLICY.fall):
        apply_probe(state, False, POLICY, float(t))
    assert state.up is False
    assert state.verdict_since == float(2 + POLICY.fall)
    assert state.probe_failures_total == POLICY.fall
    apply_probe(state, False, POLICY, 50.0)
    assert state.verdict_since == float(2 + POLICY.fall)
    assert state.probe_failures_total == POLICY.fall + 1


def test_the_last_available_instance_is_never_ejected() -> None:
    """A lone instance stays in service however often it fails."""
    states = fleet(1)
    assert fail(states[0], states, 50) is False
    assert states[0].available(0.0)


def test_two_failing_instances_only_one_is_ejected() -> None:
    """With max_ejected_fraction 0.5 and two failing instances, one stays in service."""
    states = fleet(2)
    a, b = states
    assert fail(a, states, 5) is True
    assert fail(b, states, 50) is False
    assert b.available(0.0)
    assert not a.available(0.0)


@pytest.mark.parametrize(("fraction", "most"), [(0.25, 1), (0.5, 2), (0.75, 3), (1.0, 3)])
def test_ejection_respects_max_ejected_fraction(fraction: float, most: int) -> None:
    """Of four failing instances at most `max_ejected_fraction` are out, and never all."""
    policy = HealthPolicy(eject_after_failures=1, max_ejected_fraction=fraction)
    states = fleet(4)
    for state in states:
        apply_outcome(state, Outcome.FAILURE, 0.0, policy, states)
    assert sum(1 for s in states if not s.available(0.0)) == most


def test_down_instances_count_toward_the_ejected_fraction() -> None:
    """An instance already down by its probes uses up the ejection allowance."""
    policy = HealthPolicy(fall=1, eject_after_failures=1, max_ejected_fraction=0.5)
    states = fleet(4)
    apply_probe(states[0], False, policy, 0.0)
    apply_probe(states[1], False, policy, 0.0)
    assert apply_outcome(states[2], Outcome.FAILURE, 0.0, policy, states) is False


# ------------------------------------------------------------------ through the scheduler


def test_scheduler_stops_sending_to_an_ejected_instance() -> None:
    """Failed releases eject an instance; requests avoid it until its ejection ends."""
    rng = random.Random(0)
    policy = HealthPolicy(eject_after_failures=2, ejection_base=10)
    sched = Scheduler(
        [InstanceSpec("a"), InstanceSpec("b")], STRATEGIES["least_busy"](30.0), Limits(), policy
    )
    for name in ("a", "b"):
        sched.probe(name, True, 0.0, rng)
    for i in (1, 2):
        decision = sched.submit(Ticket(i, Lane.SHORT, 1e9, frozenset({"b"})), 0.0, rng)
        assert decision == Assigned(Ticket(i, Lane.SHORT, 1e9, frozenset({"b"})), "a")
        sched.release(i, Outcome.FAILURE, 0.0, rng)
    assert sched.state("a").ejected_until == 10.0
    for i in range(3, 13):
        decision = sched.submit(Ticket(i, Lane.SHORT, 1e9), 5.0, rng)
        assert isinstance(decision, Assigned)
        assert decision.instance == "b"
    decision = sched.submit(Ticket(99, Lane.SHORT, 1e9), 10.0, rng)
    assert isinstance(decision, Assigned)
    assert decision.instance == "a"


def test_the_last_instance_of_a_lane_is_never_ejected() -> None:
    """Passive ejection keeps a lane's only instance, though the fleet-wide share allows it."""
    policy = HealthPolicy(eject_after_failures=1, max_ejected_fraction=0.5)
    short = InstanceState(InstanceSpec("s", lane="short"), up=True)
    long = InstanceState(InstanceSpec("l", lane="long"), up=True)
    fleet = [short, long]
    assert not apply_outcome(long, Outcome.FAILURE, 0.0, policy, fleet)
    assert long.available(0.0)


def test_failures_while_ejected_do_not_count_toward_the_next_ejection() -> None:
    """Requests that fail while an instance is out are not held against it when it returns."""
    policy = HealthPolicy(eject_after_failures=2, ejection_base=10, max_ejected_fraction=1.0)
    a = InstanceState(InstanceSpec("a"), up=True)
    fleet = [a, InstanceState(InstanceSpec("b"), up=True)]
    apply_outcome(a, Outcome.FAILURE, 0.0, policy, fleet)
    assert apply_outcome(a, Outcome.FAILURE, 0.0, policy, fleet)
    for _ in range(5):  # stragglers sent before the ejection fail while it is out
        apply_outcome(a, Outcome.FAILURE, 1.0, policy, fleet)
    assert a.consecutive_failures == 0
    assert not apply_outcome(a, Outcome.FAILURE, 11.0, policy, fleet)
    assert a.available(11.0)


def test_good_probes_decay_the_ejection_multiplier_once_back() -> None:
    """Each good probe after an ejection ended takes one step off the next ejection's time,
    down to the base; a good probe while still ejected takes nothing off."""
    states = fleet(2)
    a = states[0]
    fail(a, states, 5, now=0.0)
    fail(a, states, 5, now=10.0)
    assert (a.ejections, a.ejected_until) == (2, 30.0)
    apply_probe(a, True, POLICY, 0.0)  # still ejected: no decay
    assert a.ejections == 2
    assert not apply_outcome(a, Outcome.FAILURE, 20.0, POLICY, states)  # out already
    apply_outcome(a, Outcome.SUCCESS, 30.0, POLICY, states)  # back: the ejection is over
    assert a.ejected_until is None
    for expected in (1, 0, 0):
        apply_probe(a, True, POLICY, 0.0)
        assert a.ejections == expected
    fail(a, states, 5, now=40.0)
    assert a.ejected_until == 50.0  # the base time again
    assert a.ejections_total == 3


def test_a_good_probe_of_an_up_instance_keeps_its_failure_count() -> None:
    """Probes of an instance that stays up leave consecutive failures to the requests."""
    states = fleet(2)
    a = states[0]
    fail(a, states, 3)
    apply_probe(a, True, POLICY, 0.0)
    assert a.consecutive_failures == 3
    assert fail(a, states, 2)  # the 5th failure in a row still ejects
