"""Prometheus metrics, on a registry owned by the app (never the global one).

Request-path metrics are counters and histograms updated once per request. Everything
that describes current state (queue depths, in-flight, up/down, scraped vLLM load) is
read from the scheduler at scrape time by `StateCollector`, so the hot path pays nothing
for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .dispatch import Lane, Scheduler, score_all

# TTFT spans a cached short prompt (tens of ms) to a long prefill behind a queue (a minute).
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320)

OTHER_TAG = "other"
CONNECTION_CUTS = ("header_timeout", "body_timeout", "idle_timeout", "over_limit")


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        max_tags: int = 20,
        lane_names: dict[Lane, str] | None = None,
    ) -> None:
        self.registry = registry
        # How lanes are named in labels and logs (the app names the long one [prefill].tag).
        self.lane_names = lane_names or {lane: lane.value for lane in Lane}
        self.max_tags = max_tags
        self._tags: set[str] = set()
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by route, status, lane, model (those the fleet serves; others "
            "fold into 'other') and (capped) X-Request-Tag.",
            ["route", "status", "lane", "model", "tag"],
            registry=registry,
        )
        self.instance_requests = Counter(
            "gateway_instance_requests",
            "Attempts sent to each instance, by the status it answered (or the error).",
            ["instance", "status"],
            registry=registry,
        )
        self.retries = Counter(
            "gateway_retries", "Retries, by reason.", ["reason"], registry=registry
        )
        self.retries_refused = Counter(
            "gateway_retries_refused",
            "Retries not made, by why (attempts, deadline, budget).",
            ["why"],
            registry=registry,
        )
        self.rejections = Counter(
            "gateway_rejections",
            "Requests the gateway turned away itself, by reason.",
            ["reason"],
            registry=registry,
        )
        self.stream_aborts = Counter(
            "gateway_stream_aborts",
            "Streams ended after they started, by which side broke them.",
            ["side"],
            registry=registry,
        )
        self.slo = Counter(
            "gateway_slo_requests",
            "Streamed requests by whether they met their lane's TTFT / TPOT objective.",
            ["lane", "instance", "objective", "result"],
            registry=registry,
        )
        self.goodput = Counter(
            "gateway_goodput_requests",
            "Streamed requests that met both objectives of their lane (rate() = goodput).",
            ["lane", "instance"],
            registry=registry,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "Time to first token (first streamed chunk), from arrival at the gateway.",
            ["lane"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "gateway_tpot_seconds",
            "Time per output token after the first, of streamed answers.",
            ["lane"],
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds",
            "End-to-end time of requests that reached an instance.",
            ["lane"],
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time requests spent in the gateway queue before an instance took them.",
            ["lane"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )

        self.client_connections = Gauge(
            "gateway_client_connections",
            "Client connections open now (not counting those refused over the cap).",
            registry=registry,
        )
        self.client_connections_closed = Counter(
            "gateway_client_connections_closed",
            "Client connections the gateway cut, by reason (a timeout or the cap).",
            ["reason"],
            registry=registry,
        )
        for reason in CONNECTION_CUTS:  # every series exists at 0 from the start
            self.client_connections_closed.labels(reason)
        self.config_reloads = Counter(
            "gateway_config_reloads",
            "SIGHUP reloads of config.toml and settings.json, by result (applied or failed).",
            ["result"],
            registry=registry,
        )
        for result in ("applied", "failed"):
            self.config_reloads.labels(result)
        self.config_last_reload_successful = Gauge(
            "gateway_config_last_reload_successful",
            "1 if the last reload applied (or none was tried), 0 if it failed: the files on "
            "disk are not what the gateway runs.",
            registry=registry,
        )
        self.config_last_reload_successful.set(1)

    def tag_label(self, tag: str) -> str:
        """The tag itself while fewer than `max_tags` distinct tags were seen, else 'other'."""
        if tag in self._tags:
            return tag
        if len(self._tags) < self.max_tags:
            self._tags.add(tag)
            return tag
        return OTHER_TAG

    def watch(self, scheduler: Scheduler, now: Callable[[], float]) -> None:
        self.registry.register(StateCollector(scheduler, now, self.lane_names))


class StateCollector(Collector):
    """Reads the scheduler's live state when Prometheus scrapes."""

    def __init__(
        self, scheduler: Scheduler, now: Callable[[], float], lane_names: dict[Lane, str]
    ) -> None:
        self.scheduler = scheduler
        self.now = now
        self.lane_names = lane_names

    def collect(self) -> Iterator[Metric]:
        now = self.now()
        sched = self.scheduler
        stale = sched.limits.metrics_stale_after
        scores = score_all(sched.states, now, stale)
        families = {
            "queue_depth": GaugeMetricFamily(
                "gateway_instance_queue_depth",
                "Requests waiting at each instance beyond its running slots: the larger of "
                "the gateway's own count and the instance's fresh vllm:num_requests_waiting.",
                labels=["instance"],
            ),
            "inflight": GaugeMetricFamily(
                "gateway_instance_inflight",
                "Requests this gateway has in flight on each instance.",
                labels=["instance"],
            ),
            "up": GaugeMetricFamily(
                "gateway_instance_up",
                "1 if the instance takes traffic (probes pass, not ejected), else 0.",
                labels=["instance"],
            ),
            "score": GaugeMetricFamily(
                "gateway_instance_score",
                "The least_busy score of each instance (lower takes the next request).",
                labels=["instance"],
            ),
            "running": GaugeMetricFamily(
                "gateway_instance_vllm_running",
                "vllm:num_requests_running at the last scrape (NaN if never or stale).",
                labels=["instance"],
            ),
            "waiting": GaugeMetricFamily(
                "gateway_instance_vllm_waiting",
                "vllm:num_requests_waiting at the last scrape (NaN if never or stale).",
                labels=["instance"],
            ),
            "prefill_rate": GaugeMetricFamily(
                "gateway_instance_prefill_rate_tokens_per_second",
                "Learned prefill throughput of each instance (NaN before any streamed answer).",
                labels=["instance"],
            ),
            "tpot": GaugeMetricFamily(
                "gateway_instance_tpot_estimate_seconds",
                "Learned time per output token of each instance (NaN before any).",
                labels=["instance"],
            ),
            "slow": GaugeMetricFamily(
                "gateway_instance_slow",
                "1 while the instance's learned speed is well below the fleet median.",
                labels=["instance"],
            ),
            "kv": GaugeMetricFamily(
                "gateway_instance_vllm_kv_cache_usage",
                "vllm:kv_cache_usage_perc at the last scrape, 0..1 (NaN if unknown).",
                labels=["instance"],
            ),
        }
        prefix: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "index": GaugeMetricFamily(
                "gateway_prefix_index_blocks",
                "Prompt blocks (64 tokens) the gateway remembers sending to each instance.",
                labels=["instance"],
            ),
            "queries": CounterMetricFamily(
                "gateway_prefix_query_tokens",
                "Prompt tokens sent to each instance with a prefix estimate.",
                labels=["instance"],
            ),
            "hits": CounterMetricFamily(
                "gateway_prefix_estimated_hit_tokens",
                "Of those, the tokens the gateway estimated were in the instance's prefix cache.",
                labels=["instance"],
            ),
            "vllm_queries": CounterMetricFamily(
                "gateway_instance_vllm_prefix_cache_query_tokens",
                "vllm:prefix_cache_queries_total at the instance's last scrape (its own count).",
                labels=["instance"],
            ),
            "vllm_hits": CounterMetricFamily(
                "gateway_instance_vllm_prefix_cache_hit_tokens",
                "vllm:prefix_cache_hits_total at the instance's last scrape (its own count).",
                labels=["instance"],
            ),
        }
        ejections = CounterMetricFamily(
            "gateway_instance_ejections",
            "Passive ejections of each instance after consecutive failures.",
            labels=["instance"],
        )
        for state in sched.states:
            name = [state.name]
            report = state.fresh_report(now, stale)
            nan = float("nan")
            families["queue_depth"].add_metric(name, state.queue_depth(report))
            families["inflight"].add_metric(name, state.inflight)
            families["up"].add_metric(name, 1.0 if state.available(now) else 0.0)
            families["score"].add_metric(name, scores[state.name].total)
            families["running"].add_metric(name, report.running if report else nan)
            families["waiting"].add_metric(name, report.waiting if report else nan)
            kv = report.kv_usage if report else None
            families["kv"].add_metric(name, nan if kv is None else kv)
            ejections.add_metric(name, state.ejections_total)
            rate, tpot = state.speed.prefill.value, state.speed.tpot.value
            families["prefill_rate"].add_metric(name, float("nan") if rate is None else rate)
            families["tpot"].add_metric(name, float("nan") if tpot is None else tpot)
            families["slow"].add_metric(name, 1.0 if state.speed.slow else 0.0)
            prefix["index"].add_metric(name, len(state.cache))
            prefix["queries"].add_metric(name, state.prefix_query_tokens)
            prefix["hits"].add_metric(name, state.prefix_hit_tokens)
            last = state.report  # the instance's own counters, however old the scrape
            if last is not None and last.prefix_queries is not None:
                prefix["vllm_queries"].add_metric(name, last.prefix_queries)
            if last is not None and last.prefix_hits is not None:
                prefix["vllm_hits"].add_metric(name, last.prefix_hits)
        yield from families.values()
        yield from prefix.values()
        yield ejections
        lanes = GaugeMetricFamily(
            "gateway_queue_depth",
            "Requests waiting in the gateway queue, by lane.",
            labels=["lane"],
        )
        for lane in Lane:
            lanes.add_metric([self.lane_names[lane]], sched.queue_length(lane))
        yield lanes
