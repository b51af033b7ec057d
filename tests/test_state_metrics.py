"""The gauges read from a scheduler snapshot at scrape time, over a scheduler driven by hand:
no event loop, no HTTP, the collector's families read as Prometheus would see them."""

from __future__ import annotations

import dataclasses
import math
import random

from prometheus_client.parser import text_string_to_metric_families

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    HealthPolicy,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Queued,
    Scheduler,
    Ticket,
)
from gateway.observe.metrics import Metrics, Registry
from gateway.observe.metrics_merge import merge, render
from gateway.observe.saturation import fleet_saturation

FAR = 1e9  # a deadline no test reaches


def make(*specs: InstanceSpec, limits: Limits | None = None) -> Scheduler:
    limits = limits or Limits()
    return Scheduler(
        list(specs), STRATEGIES["least_busy"](limits.metrics_stale_after), limits, HealthPolicy()
    )


def gauges(sched: Scheduler, now: float, name: str) -> dict[tuple[str, ...], float]:
    """The samples of the family `name` at `now`, by their label values."""
    registry = Registry()
    Metrics(registry).watch(lambda: sched.snapshot(now))
    return {
        tuple(sample.labels.values()): sample.value
        for family in registry.collect()
        if family.name == name
        for sample in family.samples
    }


def test_scrape_age_counts_from_the_last_read_and_is_infinite_before_the_first() -> None:
    """An instance read at 10 s is 25 s old at 35 s (past the 30 s staleness limit, still
    counted from its last read); one never read is +Inf, so an alert sees it too."""
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    rng = random.Random(1)
    for name in ("a", "b"):
        sched.probe(name, True, 0.0, rng)
    sched.report_load("a", LoadReport(running=1, waiting=0, kv_usage=0.1, at=10.0))
    ages = gauges(sched, 35.0, "gateway_instance_scrape_age_seconds")
    assert ages[("a",)] == 25.0
    assert ages[("b",)] == math.inf
    later = gauges(sched, 100.0, "gateway_instance_scrape_age_seconds")
    assert later[("a",)] == 90.0


def test_with_workers_the_freshest_read_of_an_instance_wins() -> None:
    """Merged across workers, an instance's scrape age is the youngest any worker has, and
    +Inf only if none has read it: one worker's failing reads do not fire the alert."""
    head = "# TYPE gateway_instance_scrape_age_seconds gauge\n"
    workers = [
        head + 'gateway_instance_scrape_age_seconds{server="a"} 4.0\n'
        'gateway_instance_scrape_age_seconds{server="b"} +Inf\n',
        head + 'gateway_instance_scrape_age_seconds{server="a"} 300.0\n'
        'gateway_instance_scrape_age_seconds{server="b"} +Inf\n',
    ]
    merged = text_string_to_metric_families(render(merge(workers)).decode())
    ages = {s.labels["server"]: s.value for f in merged for s in f.samples}
    assert ages["a"] == 4.0
    assert math.isinf(ages["b"])


def fleet(*specs: InstanceSpec) -> tuple[Scheduler, random.Random]:
    """Instances up, none holding a queue of its own: the overflow waits in the gateway."""
    sched = make(*specs, limits=Limits(max_queue_per_instance=0))
    rng = random.Random(1)
    for spec in specs:
        sched.probe(spec.name, True, 0.0, rng)
    return sched, rng


def submit(sched: Scheduler, rng: random.Random, model: str, n: int) -> list[object]:
    return [
        sched.submit(Ticket(1000 + i, Lane.SHORT, FAR, model=model), 1.0, rng) for i in range(n)
    ]


def test_saturation_is_the_models_demand_over_its_slots() -> None:
    """Ten requests for m on two instances of 4 slots: 8 run, 2 wait in the gateway, 10/8;
    an instance that says it runs 4 and holds 3 waiting (traffic from elsewhere) counts 7,
    not our 4; a model nobody asks for is at 0."""
    sched, rng = fleet(
        InstanceSpec("a", slots=4, models=frozenset({"m"})),
        InstanceSpec("b", slots=4, models=frozenset({"m"})),
        InstanceSpec("c", slots=2, models=frozenset({"n"})),
    )
    decisions = submit(sched, rng, "m", 10)
    assert sum(isinstance(d, Assigned) for d in decisions) == 8
    assert sum(isinstance(d, Queued) for d in decisions) == 2
    snap = sched.snapshot(2.0)
    assert dict(snap.model_queued) == {"m": 2}
    assert fleet_saturation(snap) == {"m": 10 / 8, "n": 0.0}
    sched.report_load("a", LoadReport(running=4, waiting=3, kv_usage=0.9, at=2.0))
    assert fleet_saturation(sched.snapshot(3.0)) == {"m": (2 + 7 + 4) / 8, "n": 0.0}
    # The scrape goes stale: the gateway's own count of a's requests again.
    stale = sched.snapshot(2.0 + Limits().metrics_stale_after + 1)
    assert fleet_saturation(stale)["m"] == 10 / 8
    exported = gauges(sched, 3.0, "gateway_fleet_saturation")
    assert exported == {("m",): 13 / 8, ("n",): 0.0}


def test_down_instances_leave_the_capacity_and_no_capacity_with_demand_is_infinite() -> None:
    """A down instance's slots and load leave its model's figure; with every instance of a
    model down, requests waiting for it make +Inf (scale up), none waiting 0."""
    sched, rng = fleet(
        InstanceSpec("a", slots=4, models=frozenset({"m"})),
        InstanceSpec("b", slots=2, models=frozenset({"m"})),
        InstanceSpec("c", slots=2, models=frozenset({"n"})),
    )
    submit(sched, rng, "m", 3)
    snap = sched.snapshot(2.0)
    a, b, c = snap.instances
    held = a.inflight + b.inflight
    assert held == 3
    a_down = dataclasses.replace(snap, instances=(dataclasses.replace(a, available=False), b, c))
    assert fleet_saturation(a_down)["m"] == b.inflight / 2
    c_down = dataclasses.replace(c, available=False)
    waiting = dataclasses.replace(snap, instances=(a, b, c_down), model_queued={"m": 0, "n": 2})
    assert fleet_saturation(waiting)["n"] == math.inf
    idle = dataclasses.replace(snap, instances=(a, b, c_down))
    assert fleet_saturation(idle)["n"] == 0.0


def test_an_instance_with_models_unknown_counts_for_every_model() -> None:
    """Before its /v1/models answers, an instance may take any model: its slots count for
    each model the others list or requests wait for."""
    sched, rng = fleet(
        InstanceSpec("a", slots=4, models=frozenset({"m"})),
        InstanceSpec("u", slots=4),
    )
    submit(sched, rng, "m", 2)
    assert fleet_saturation(sched.snapshot(2.0)) == {"m": 2 / 8}


def test_learned_slots_are_the_capacity() -> None:
    """An instance that showed it runs 2 of its 4 configured slots offers 2."""
    sched, rng = fleet(InstanceSpec("a", slots=4, models=frozenset({"m"})))
    submit(sched, rng, "m", 2)
    snap = sched.snapshot(2.0)
    (a,) = snap.instances
    fewer = dataclasses.replace(snap, instances=(dataclasses.replace(a, learned_slots=2),))
    assert fleet_saturation(fewer) == {"m": 1.0}
    assert fleet_saturation(snap) == {"m": 0.5}
