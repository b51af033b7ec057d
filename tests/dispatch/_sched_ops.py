"""What the scheduler's property test draws: a fleet with its limits and health policy
(`setups`), and lists of operations to replay against it (`operation_lists`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import strategies as st

from gateway.dispatch import STRATEGIES, HealthPolicy, InstanceSpec, Lane, Limits, Outcome

# ------------------------------------------------------------------ operations


@dataclass(frozen=True)
class Submit:
    lane: Lane
    patience: float  # deadline = now + patience; 0 is already expired
    exclude_mask: int  # bit k excludes instance k, as a retry would


@dataclass(frozen=True)
class Release:
    pick: int
    outcome: Outcome


@dataclass(frozen=True)
class PrefillDone:
    pick: int


@dataclass(frozen=True)
class Probe:
    instance: int
    ok: bool


@dataclass(frozen=True)
class Cancel:
    pick: int


@dataclass(frozen=True)
class Advance:
    seconds: float


@dataclass(frozen=True)
class Report:
    instance: int
    running: int
    waiting: int


@dataclass(frozen=True)
class PlaceWaiting:
    """A health round: queued requests may fit where an ejection ran out unannounced."""


Op = Submit | Release | PrefillDone | Probe | Cancel | Advance | Report | PlaceWaiting

picks = st.integers(0, 63)
instances = st.integers(0, 3)
submits = st.builds(
    Submit,
    st.sampled_from(list(Lane)),
    st.sampled_from([0.0, 1.0, 3.0, 30.0, 1e9, 1e9, 1e9, 1e9]),
    st.integers(0, 15) | st.just(0),
)
releases = st.builds(Release, picks, st.sampled_from(list(Outcome)))
# Listed more than once to weight the mix toward traffic: one_of picks branches uniformly.
ops = st.one_of(
    submits,
    submits,
    submits,
    submits,
    releases,
    releases,
    st.builds(PrefillDone, picks),
    st.builds(Probe, instances, st.sampled_from([True, True, False])),
    st.builds(Cancel, picks),
    st.builds(Advance, st.sampled_from([0.5, 2.0, 7.0])),
    st.builds(Report, instances, st.integers(0, 20), st.integers(0, 20)),
    st.just(PlaceWaiting()),
)
operation_lists = st.lists(ops, min_size=40, max_size=150)


@dataclass(frozen=True)
class Setup:
    specs: tuple[InstanceSpec, ...]
    limits: Limits
    policy: HealthPolicy
    strategy: str
    initially_up: tuple[bool, ...]
    seed: int


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    n = draw(st.integers(1, 4))
    specs = tuple(
        InstanceSpec(
            f"i{k}",
            lane=draw(st.sampled_from(["short", "long", "any"])),
            slots=draw(st.integers(1, 4)),
            weight=draw(st.sampled_from([1.0, 2.0])),
        )
        for k in range(n)
    )
    limits = Limits(
        max_queue_per_instance=draw(st.integers(0, 3)),
        max_long_per_instance=draw(st.integers(1, 2)),
        gateway_queue_size=draw(st.integers(0, 5)),
        global_limit=draw(st.none() | st.integers(1, 8)),
        metrics_stale_after=5.0,
        max_queue_wait_short=draw(st.sampled_from([math.inf, 1.0, 4.0])),
        max_queue_wait_long=draw(st.sampled_from([math.inf, 3.0])),
    )
    policy = HealthPolicy(
        rise=draw(st.integers(1, 2)),
        fall=draw(st.integers(1, 2)),
        eject_after_failures=draw(st.integers(1, 3)),
        ejection_base=draw(st.sampled_from([1.0, 5.0])),
        ejection_max=20.0,
        max_ejected_fraction=draw(st.sampled_from([0.25, 0.5, 1.0])),
        busy_penalty=draw(st.sampled_from([0.5, 3.0])),
    )
    return Setup(
        specs=specs,
        limits=limits,
        policy=policy,
        strategy=draw(st.sampled_from(sorted(STRATEGIES))),
        initially_up=tuple(draw(st.sampled_from([True, True, True, False])) for _ in specs),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
