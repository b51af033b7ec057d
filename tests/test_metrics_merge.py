"""The merge of several workers' Prometheus expositions into one (metrics_merge.py)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.observe.metrics_merge import COUNTERS, DEFAULT_GAUGE, GAUGES, merge, mode_of, render


def _worker(
    requests: int,
    ttfts: list[float],
    *,
    inflight: float = 0,
    up: float = 1,
    rate: float = math.nan,
    extra_gauge: float | None = None,
    vllm_queries: float | None = None,
) -> str:
    """One worker's exposition, written by prometheus_client as the gateway writes it."""
    registry = CollectorRegistry()
    counter = Counter("gateway_requests", "Requests.", ["route", "status"], registry=registry)
    counter.labels("chat", "200").inc(requests)
    ttft = Histogram(
        "gateway_ttft_seconds", "TTFT.", ["lane"], buckets=(0.1, 1.0), registry=registry
    )
    for value in ttfts:
        ttft.labels("short").observe(value)
    gauges = {
        "gateway_instance_inflight": inflight,
        "gateway_instance_up": up,
        "gateway_instance_prefill_rate_tokens_per_second": rate,
    }
    for name, value in gauges.items():
        Gauge(name, "A gauge.", ["instance"], registry=registry).labels("a").set(value)
    if extra_gauge is not None:
        Gauge("gateway_something_new", "Unknown.", registry=registry).set(extra_gauge)
    if vllm_queries is not None:
        mirrored = Counter(
            "gateway_instance_vllm_prefix_cache_query_tokens",
            "The instance's own.",
            ["instance"],
            registry=registry,
        )
        mirrored.labels("a").inc(vllm_queries)
    return generate_latest(registry).decode()


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and labels."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _value(text: bytes, name: str, **labels: str) -> float:
    return _samples(text)[(name, tuple(sorted(labels.items())))]


def test_counters_add_up_across_workers() -> None:
    """A counter of the merged answer is the sum of every worker's."""
    merged = render(merge([_worker(3, []), _worker(4, []), _worker(0, [])]))
    assert _value(merged, "gateway_requests_total", route="chat", status="200") == 7


def test_histograms_add_bucket_by_bucket() -> None:
    """Histogram buckets, sums and counts add up, so quantiles see every worker's samples."""
    merged = render(merge([_worker(0, [0.05, 0.5]), _worker(0, [2.0])]))
    bucket = "gateway_ttft_seconds_bucket"
    assert _value(merged, bucket, lane="short", le="0.1") == 1
    assert _value(merged, bucket, lane="short", le="1.0") == 2
    assert _value(merged, bucket, lane="short", le="+Inf") == 3
    assert _value(merged, "gateway_ttft_seconds_count", lane="short") == 3
    assert _value(merged, "gateway_ttft_seconds_sum", lane="short") == 2.55


def test_gauges_keep_their_meaning() -> None:
    """In-flight adds up, an up flag is not doubled, a learned speed is averaged."""
    merged = render(
        merge([_worker(0, [], inflight=2, rate=100), _worker(0, [], inflight=5, rate=300)])
    )
    assert _value(merged, "gateway_instance_inflight", instance="a") == 7
    assert _value(merged, "gateway_instance_up", instance="a") == 1
    assert _value(merged, "gateway_instance_prefill_rate_tokens_per_second", instance="a") == 200


def test_an_up_flag_is_1_when_any_worker_sees_the_instance_up() -> None:
    """`gateway_instance_up` takes the largest: one worker that still sees it up says 1."""
    merged = render(merge([_worker(0, [], up=0), _worker(0, [], up=1)]))
    assert _value(merged, "gateway_instance_up", instance="a") == 1


def test_unknown_values_are_left_out_and_all_unknown_stays_nan() -> None:
    """A NaN from one worker does not spoil a mean; NaN from every worker stays NaN."""
    one = render(merge([_worker(0, [], rate=math.nan), _worker(0, [], rate=50)]))
    assert _value(one, "gateway_instance_prefill_rate_tokens_per_second", instance="a") == 50
    none = render(merge([_worker(0, []), _worker(0, [])]))
    assert math.isnan(_value(none, "gateway_instance_prefill_rate_tokens_per_second", instance="a"))


def test_a_gauge_not_in_the_table_adds_up() -> None:
    """A gauge the table does not name is summed, as documented."""
    assert DEFAULT_GAUGE == "sum"
    merged = render(merge([_worker(0, [], extra_gauge=2), _worker(0, [], extra_gauge=3)]))
    assert _value(merged, "gateway_something_new") == 5


def test_a_copied_instance_counter_is_not_multiplied_by_the_workers() -> None:
    """The instance's own prefix-cache counter, copied by every worker, is counted once."""
    merged = render(merge([_worker(0, [], vllm_queries=900), _worker(0, [], vllm_queries=1000)]))
    name = "gateway_instance_vllm_prefix_cache_query_tokens_total"
    assert _value(merged, name, instance="a") == 1000


def test_created_timestamps_take_the_earliest() -> None:
    """A `_created` series (when a counter started) is the earliest worker's, not a sum."""
    assert mode_of("gateway_requests_created", "gauge") == "min"
    first, second = _worker(1, []), _worker(1, [])
    created = [
        _value(text.encode(), "gateway_requests_created", route="chat", status="200")
        for text in (first, second)
    ]
    merged = render(merge([first, second]))
    assert _value(merged, "gateway_requests_created", route="chat", status="200") == min(created)


def test_series_only_some_workers_have_are_kept() -> None:
    """A label set only one worker has seen appears in the merge with that worker's value."""
    registry = CollectorRegistry()
    Counter("gateway_retries", "Retries.", ["reason"], registry=registry).labels("status").inc(2)
    merged = render(merge([_worker(1, []), generate_latest(registry).decode()]))
    assert _value(merged, "gateway_retries_total", reason="status") == 2
    assert _value(merged, "gateway_requests_total", route="chat", status="200") == 1


def test_the_merge_of_one_exposition_is_that_exposition() -> None:
    """Merging one worker's text changes no sample: the merge adds nothing of its own."""
    text = _worker(3, [0.05, 2.0], inflight=1, rate=7)
    assert _samples(render(merge([text]))) == _samples(text.encode())


def test_a_family_of_another_type_is_skipped() -> None:
    """A worker whose family has another type than the first one's does not corrupt it."""
    registry = CollectorRegistry()
    Counter("gateway_instance_up", "Wrong type.", ["instance"], registry=registry).labels("a").inc(
        5
    )
    merged = merge([_worker(0, [], up=1), generate_latest(registry).decode()])
    up = next(f for f in merged if f.name == "gateway_instance_up")
    assert up.type == "gauge"
    assert up.samples == [Sample("gateway_instance_up", {"instance": "a"}, 1.0)]


def _gateway_facts(start: float, max_fds: float, reload_ok: float, reloads: float) -> str:
    """The facts each worker states about the one gateway, as its registry writes them."""
    registry = CollectorRegistry()
    Gauge("process_start_time_seconds", "Start.", registry=registry).set(start)
    Gauge("process_max_fds", "Limit.", registry=registry).set(max_fds)
    Gauge("gateway_config_last_reload_successful", "Ok.", registry=registry).set(reload_ok)
    Counter("gateway_config_reloads", "Reloads.", ["result"], registry=registry).labels(
        "applied"
    ).inc(reloads)
    Gauge("gateway_config_info", "Digest.", ["hash"], registry=registry).labels("ab12").set(1)
    return generate_latest(registry).decode()


def test_the_gateways_own_facts_are_not_added_up() -> None:
    """Start time, fd limit, reload state and count, config digest: one gateway's, not N."""
    merged = render(merge([_gateway_facts(100, 1024, 1, 3), _gateway_facts(90, 2048, 0, 3)]))
    assert _value(merged, "process_start_time_seconds") == 90
    assert _value(merged, "process_max_fds") == 1024
    assert _value(merged, "gateway_config_last_reload_successful") == 0  # one worker failed
    assert _value(merged, "gateway_config_reloads_total", result="applied") == 3
    assert _value(merged, "gateway_config_info", hash="ab12") == 1


def test_every_named_family_is_one_the_gateway_exposes() -> None:
    """A mode for a family the gateway does not expose is a typo that leaves the real one
    on the default (a scraped ratio summed over the workers): every name in the tables is
    a family of the gateway's registry, or of prometheus_client's process and platform
    collectors. The shared view's collector is read off a stand-in of its state."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from gateway.dispatch import STRATEGIES, HealthPolicy, InstanceSpec, Limits, Scheduler
    from gateway.fleet.shared import SharedStateCollector
    from gateway.observe.metrics import Metrics, Registry

    limits = Limits()
    sched = Scheduler(
        [InstanceSpec("a")], STRATEGIES["least_busy"](limits.metrics_stale_after), limits,
        HealthPolicy(),
    )  # fmt: skip
    registry = Registry()
    Metrics(registry).watch(lambda: sched.snapshot(0.0))
    registry.register(SharedStateCollector(SimpleNamespace(up=True, peers=0, errors={})))  # type: ignore[arg-type]
    exposed = {family.name for family in registry.collect()}
    exposed |= {family.name for family in REGISTRY.collect()}
    assert set(GAUGES) - exposed == set()
    assert set(COUNTERS) - exposed == set()
