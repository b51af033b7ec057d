"""Health verdicts: active probes with rise/fall, passive ejection with growing time.

Pure functions over `InstanceState`; the scheduler calls them and the shell feeds them
probe answers and request outcomes with its own clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from .model import HealthPolicy, InstanceState, Lane, Outcome

_RECENT_ERRORS = 5


def ejection_time(ejections: int, policy: HealthPolicy) -> float:
    """How long the n-th ejection in a row lasts: base, 2x, 4x, ... capped.

    With base 10 s and max 300 s: 10, 20, 40, 80, 160, 300, 300, ...
    """
    return float(min(policy.ejection_max, policy.ejection_base * 2 ** max(0, ejections - 1)))


def apply_probe(state: InstanceState, ok: bool, policy: HealthPolicy, now: float) -> bool:
    """Record one active probe; return True when the up/down verdict changed.

    The first probe decides at once (start-up should not wait rise x interval); after
    that it takes `rise` good probes in a row to come up and `fall` bad ones to go down,
    so one slow answer does not flap an instance.
    """
    if ok:
        state.probe_streak = max(0, state.probe_streak) + 1
    else:
        state.probe_streak = min(0, state.probe_streak) - 1
        state.probe_failures_total += 1
    before = state.up
    if state.up is None:
        state.up = ok
    elif not state.up and state.probe_streak >= policy.rise:
        state.up = True
    elif state.up and -state.probe_streak >= policy.fall:
        state.up = False
    if ok and state.ejected_until is None and state.ejections > 0:
        # A healthy interval decays the ejection multiplier one step, as Envoy does.
        state.ejections -= 1
    if state.up and not before:
        state.consecutive_failures = 0
    if state.up != before:
        state.verdict_since = now
    return state.up != before


def apply_outcome(
    state: InstanceState,
    outcome: Outcome,
    now: float,
    policy: HealthPolicy,
    fleet: Sequence[InstanceState],
    error: str | None = None,
) -> bool:
    """Record a request's outcome on `state`; return True if the instance got ejected.

    Ejection never takes the fleet below the panic threshold: at most
    `max_ejected_fraction` of instances may be out, and never the last available
    instance of a lane.
    """
    if state.ejected_until is not None and now >= state.ejected_until:
        state.ejected_until = None
    if outcome is Outcome.SUCCESS:
        state.consecutive_failures = 0
        return False
    if outcome is Outcome.NEUTRAL:
        return False
    if outcome is Outcome.BUSY:
        # Fast "busy" answers would make an instance look idle and attract traffic
        # (linkerd2-proxy#4537); it is alive, so this is a short penalty, not a failure.
        state.busy_until = now + policy.busy_penalty
        return False
    state.failures_total += 1
    if error:
        note_error(state, error, now)
    if state.ejected_until is not None:
        return False  # failures of requests sent before the ejection do not count again
    state.consecutive_failures += 1
    if state.consecutive_failures < policy.eject_after_failures:
        return False
    out = sum(1 for s in fleet if not s.available(now))
    if (out + 1) / len(fleet) > policy.max_ejected_fraction:
        return False
    # Never the last available instance of a lane it serves.
    for lane in Lane:
        if state.serves(lane):
            others = (s for s in fleet if s is not state and s.serves(lane))
            if not any(s.available(now) for s in others):
                return False
    state.ejections += 1
    state.ejections_total += 1
    state.ejected_until = now + ejection_time(state.ejections, policy)
    state.consecutive_failures = 0
    return True


def note_error(state: InstanceState, error: str, now: float) -> None:
    """Keep `error` (and when) among the instance's last few, for /admin/instances."""
    state.recent_errors.append((now, error))
    del state.recent_errors[:-_RECENT_ERRORS]
