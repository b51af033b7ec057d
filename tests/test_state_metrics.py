"""The gauges read from a scheduler snapshot at scrape time, over a scheduler driven by hand:
no event loop, no HTTP, the collector's families read as Prometheus would see them."""

from __future__ import annotations

import math
import random

from prometheus_client.parser import text_string_to_metric_families

from gateway.dispatch import (
    STRATEGIES,
    HealthPolicy,
    InstanceSpec,
    Limits,
    LoadReport,
    Scheduler,
)
from gateway.observe.metrics import Metrics, Registry
from gateway.observe.metrics_merge import merge, render


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
