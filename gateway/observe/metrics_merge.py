"""One Prometheus exposition from several workers' expositions, as if one process answered.

With `gateway --workers N` a scrape of `/metrics` lands on one worker, which fetches the
others' text (peer_metrics.py) and merges it here. Pure: text in, metric families out.

Samples are matched by name and labels. How the workers' values combine depends on what
the metric means:

- counters and histograms (buckets, `_sum`, `_count`) add up: each worker counts its
  own requests. A counter that copies an instance's own count (every worker scrapes the
  same vLLM counter) takes the largest instead;
- gauges go by `GAUGES`, a table by metric name: `sum` for what each worker holds on its
  own (in-flight requests, its queue, its client connections), `max` for flags and for
  views of the instance that every worker shares (up, slow, the instance's queue),
  `mean` for estimates (learned speeds, scores, the instance's scraped load, KV usage),
  `min` for `gateway_shared_state_up` (1 only while every worker has the shared view);
- a `*_created` gauge (prometheus_client's start time of a counter or histogram) takes
  the earliest;
- a gauge not in the table adds up (`DEFAULT_GAUGE`): most of ours count things a
  worker holds, and a new one that should not add up belongs in the table.

NaN (unknown) values are left out of every mode; a sample unknown to every worker stays
NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

Combine = Callable[[list[float]], float]


def _known(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _sum(values: list[float]) -> float:
    known = _known(values)
    return math.fsum(known) if known else math.nan


def _max(values: list[float]) -> float:
    known = _known(values)
    return max(known) if known else math.nan


def _min(values: list[float]) -> float:
    known = _known(values)
    return min(known) if known else math.nan


def _mean(values: list[float]) -> float:
    known = _known(values)
    return math.fsum(known) / len(known) if known else math.nan


MODES: dict[str, Combine] = {"sum": _sum, "max": _max, "min": _min, "mean": _mean}

DEFAULT_GAUGE = "sum"

GAUGES: dict[str, str] = {
    # What each worker holds itself.
    "gateway_instance_inflight": "sum",
    "gateway_queue_depth": "sum",
    "gateway_client_connections": "sum",
    # Flags, and views of the instance every worker has (the instance's queue is the
    # larger of the fleet's count and its own num_requests_waiting: adding would count
    # the same requests once per worker).
    "gateway_instance_up": "max",
    "gateway_instance_slow": "max",
    "gateway_instance_queue_depth": "max",
    "gateway_shared_state_peers": "max",
    "gateway_shared_state_up": "min",
    # Each worker counts its own queue beside the instances' shared load: adding would
    # count that load once per worker; the largest is exact while one worker queues.
    "gateway_fleet_saturation": "max",
    # The freshest read any worker has of the instance's /metrics.
    "gateway_instance_scrape_age_seconds": "min",
    # Estimates and scraped values: each worker's is an equally good reading.
    "gateway_instance_score": "mean",
    "gateway_instance_vllm_running": "mean",
    "gateway_instance_vllm_waiting": "mean",
    "gateway_instance_vllm_kv_cache_usage_ratio": "mean",
    "gateway_instance_prefill_rate_tokens_per_second": "mean",
    "gateway_instance_tpot_estimate_seconds": "mean",
    "gateway_prefix_index_blocks": "mean",
    # One gateway's facts, which every worker states alike: its earliest start, the
    # tightest fd limit, the last reload applied only if it applied everywhere, and each
    # configuration digest served (labelled: a split shows as two series).
    "process_start_time_seconds": "min",
    "process_max_fds": "min",
    "gateway_config_last_reload_successful": "min",
    "gateway_config_info": "max",
    "python_info": "max",
}

# Counters that copy an instance's own counter: every worker reports the same number.
COUNTERS: dict[str, str] = {
    "gateway_instance_vllm_prefix_cache_query_tokens": "max",
    "gateway_instance_vllm_prefix_cache_hit_tokens": "max",
    # One SIGHUP reloads every worker: the gateway reloaded once, not once per worker.
    "gateway_config_reloads": "max",
}


def mode_of(name: str, kind: str) -> str:
    """How the workers' values of the family `name` (of type `kind`) combine."""
    if kind == "gauge":
        if name.endswith("_created"):
            return "min"
        return GAUGES.get(name, DEFAULT_GAUGE)
    if kind == "counter":
        return COUNTERS.get(name, "sum")
    return "sum"  # histograms, summaries' counts and sums, untyped


_Key = tuple[str, tuple[tuple[str, str], ...]]


def merge(expositions: Sequence[str]) -> list[Metric]:
    """The families of every exposition, each sample combined across them by `mode_of`.

    Families and samples keep the order in which they first appear. A family whose type
    differs from its first appearance (workers of different versions) is skipped there.
    Raises ValueError if a text is not in Prometheus's text format.
    """
    families: dict[str, Metric] = {}
    values: dict[str, dict[_Key, list[float]]] = {}
    labels: dict[_Key, dict[str, str]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            known = families.get(family.name)
            if known is None:
                known = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            elif known.type != family.type:
                continue
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples.setdefault(key, []).append(sample.value)
                labels.setdefault(key, sample.labels)  # as first written, in its order
    for name, family in families.items():
        combine = MODES[mode_of(name, family.type)]
        for key, found in values[name].items():
            family.add_sample(key[0], labels[key], combine(found))
    return list(families.values())


class _Fixed(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def render(families: Iterable[Metric]) -> bytes:
    """The text format of `families`, as `generate_latest` writes a registry's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry)
