"""Prometheus metrics, on a registry owned by the app (never the global one).

Request-path metrics are counters and histograms updated once per request. Current state
(queues, in-flight, up/down, vLLM load) is read by `StateCollector` from a scheduler
snapshot at scrape time, so the hot path pays nothing for it.

Conventions (what a Prometheus user expects): the vLLM instance is the label `server`
(`instance` and `job` are Prometheus' own target labels), 0..1 gauges end in `_ratio`,
`status` holds HTTP codes only, and there are no `_created` series. Labelled series whose
label values are known at start are created at zero then (`start_series`), so `rate()`
sees their first increase.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, get_args, get_type_hints

from aiohttp import __version__ as aiohttp_version
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    Summary,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway import __version__
from gateway.dispatch import GiveUp, Lane, Priority, Rejected, Snapshot
from gateway.dispatch.kv_index import KvState
from gateway.dispatch.retry import RetryReason
from gateway.observe.saturation import fleet_saturation
from gateway.upstream.response import Reported

PRIORITIES = [p.value for p in Priority]  # the SLO series' class label

# TTFT spans a cached short prompt (tens of ms) to a long prefill behind a queue (a minute).
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320)

OTHER_TAG = "other"
# A tag label unused this long gives its slot (and its series) up to a new tag: a tag that
# was a one-off leaves room for the tags in use, and series stay bounded.
TAG_IDLE_S = 600.0
NONE = "none"  # the label value of what a request never had (a lane, a model, a tag)
CONNECTION_CUTS = ("header_timeout", "body_timeout", "idle_timeout", "over_limit")
# Label values known in advance, each series created at zero by `start_series`.
ERROR_KINDS = get_args(Reported)  # an attempt that got no usable answer, as reported
RETRY_REASONS = (*get_args(RetryReason), "bad_response", "taken_back")
RETRY_REFUSALS: tuple[str, ...] = get_args(get_type_hints(GiveUp)["why"])
REJECTIONS: tuple[str, ...] = get_args(get_type_hints(Rejected)["reason"])
STREAM_ABORT_SIDES = ("client", "upstream", "shutdown")
HOP_PATHS = ("two_hop", "whole")
FALLBACK_REASONS = ("prefill_failed", "unplaced", "no_params")
HOP_PHASES = ("prefill_queue", "prefill", "decode_queue", "decode")
# What an instance answers that the gateway acts on: success, and the retryable statuses.
INSTANCE_STATUSES = ("200", "429", "502", "503", "504")
# Statuses of inference requests that were placed in a lane (answered by an instance, or
# turned away by the gateway: queue full / no instance / upstream error or timeout).
PLACED_STATUSES = ("200", "429", "502", "503", "504")
# What became of a named key's request (recorder.key_outcome), and its tokens' kinds.
KEY_OUTCOMES = (
    "ok",
    "cut",
    "error",
    "refused",
    "denied",
    "limit_requests",
    "limit_tokens",
    "limit_concurrent",
)
TOKEN_KINDS = ("prompt", "completion")


class Registry(CollectorRegistry):
    """A registry that leaves out `_created` series.

    prometheus_client's own switch (`disable_created_metrics()`) is process-global state;
    this keeps the choice on the app's registry. `_created` doubles the series of every
    counter and histogram and no dashboard here reads it.
    """

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            created = metric.name + "_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        max_tags: int = 20,
        lane_names: dict[Lane, str] | None = None,
    ) -> None:
        self.registry = registry
        self._departed: dict[str, float] = {}  # instances gone: when to forget them for good
        # How lanes are named in labels and logs (the app names the long one [prefill].tag).
        self.lane_names = lane_names or {lane: lane.value for lane in Lane}
        self.max_tags = max_tags
        self._tags: dict[str, float] = {}  # tag -> when last counted, least recent first
        self._pinned: set[str] = set()  # tags of start_series, never given up
        self._request_series: dict[tuple[str, ...], Any] = {}
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by route (unknown paths: 'other'), status, lane, model (those "
            "the fleet serves; others fold into 'other') and (capped) X-Request-Tag.",
            ["route", "status", "lane", "model", "tag"],
            registry=registry,
        )
        self.key_requests = Counter(
            "gateway_key_requests",
            "Requests of each key (its name; `default`: the unnamed keys), by model and "
            "outcome: ok, cut (a stream cut short, a client that left), error, refused "
            "(turned away by the gateway: gateway_rejections_total's reasons), denied (a "
            "model the key may not use), limit_requests, limit_tokens, limit_concurrent "
            "(refused by the key's limits).",
            ["key", "model", "outcome"],
            registry=registry,
        )
        self.key_tokens = Counter(
            "gateway_key_tokens",
            "Tokens of each key's requests by model and kind (prompt, completion), as the "
            "instance counted them in its usage; a stream cut short counts its prompt "
            "estimate and the output tokens relayed.",
            ["key", "model", "kind"],
            registry=registry,
        )
        self.instance_requests = Counter(
            "gateway_instance_requests",
            "Attempts each instance answered, by the HTTP status it answered.",
            ["server", "status"],
            registry=registry,
        )
        self.instance_errors = Counter(
            "gateway_instance_errors",
            "Attempts that got no usable answer from an instance, by kind "
            "(connect, timeout, bad_response).",
            ["server", "kind"],
            registry=registry,
        )
        self.retries = Counter(
            "gateway_retries", "Retries, by reason.", ["reason"], registry=registry
        )
        self.retries_refused = Counter(
            "gateway_retries_refused",
            "Retries not made, by why (attempts, deadline, budget, instances: none untried).",
            ["why"],
            registry=registry,
        )
        self.probe_failures = Counter(
            "gateway_instance_check_failures",
            "Health probes (check=probe, /health) and metric scrapes (check=scrape, /metrics) "
            "that failed, by reason: connect, timeout, bad_response, status_<code>, parse, "
            "no_vllm_metrics.",
            ["server", "check", "reason"],
            registry=registry,
        )
        self.taken_back = Counter(
            "gateway_requests_taken_back",
            "Requests taken back from an instance before their first token because it showed "
            "it runs fewer than configured (gateway_instance_slots): each goes elsewhere or "
            "is refused with Retry-After.",
            ["server"],
            registry=registry,
        )
        self.migrations = Counter(
            "gateway_migrations",
            "Streams continued on another instance after theirs broke them mid-answer, by "
            "why it broke (reset, eof, timeout) and outcome: completed (the client got the "
            "whole answer), failed (a continuation broke too, or none could be placed), "
            "refused (not continuable: n, logprobs, seed, structured output, a tool call in "
            "flight, the route; it ends as before).",
            ["reason", "outcome"],
            registry=registry,
        )
        for reason in ("reset", "eof", "timeout"):  # at zero: rate() sees the first break
            for outcome in ("completed", "failed"):
                self.migrations.labels(reason, outcome)
        self.discovery_failures = Counter(
            "gateway_discovery_failures",
            'Rounds in which the name of a `"discover": "dns"` instance entry could not be '
            "resolved (the entry keeps its last good addresses), by entry.",
            ["entry"],
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
            "Streamed requests by whether they met their lane's and class's TTFT / TPOT objective.",
            ["lane", "server", "objective", "result", "priority"],
            registry=registry,
        )
        self.goodput = Counter(
            "gateway_goodput_requests",
            "Streamed requests that met both objectives of their lane and class "
            "(rate() = goodput).",
            ["lane", "server", "priority"],
            registry=registry,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "Time to first token (its first streamed token), from arrival at the gateway.",
            ["lane", "server"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "gateway_tpot_seconds",
            "Time per output token after the first, of streamed answers.",
            ["lane", "server"],
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
            "Time requests spent in the gateway queue before an instance took them, by their "
            "key's class.",
            ["lane", "priority"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        # Per key, a sum and a count only (its mean over any window): the keys are the
        # configured ones, but buckets per key would multiply the series by fifteen.
        self.key_queue_wait = Summary(
            "gateway_key_queue_wait_seconds",
            "Time each key's requests spent in the gateway queue (fair share: a flooding "
            "key waits on its own).",
            ["key"],
            registry=registry,
        )
        # Prefill/decode disaggregation (proxy/disaggregate.py).
        self.hops = Counter(
            "gateway_disaggregated_requests",
            "Chat and completion requests of a fleet with prefill instances, by path: "
            "two_hop (prefilled on a prefill instance, decoded elsewhere) or whole (one "
            "instance: a prompt not worth the second hop, or a fallback).",
            ["path"],
            registry=registry,
        )
        self.hop_fallbacks = Counter(
            "gateway_prefill_fallbacks",
            "Two-hop requests whose decode instance prefilled the prompt itself, by reason: "
            "prefill_failed (every prefill attempt failed), unplaced (no prefill place in "
            "time), no_params (the prefill instance answered without kv_transfer_params: "
            "its KV connector is off).",
            ["reason"],
            registry=registry,
        )
        self.kv_unclaimed = Counter(
            "gateway_kv_unclaimed",
            "Prefilled prompts whose decode hop never reached an instance (the client left, "
            "or no decode instance took it): their KV blocks stay held on the prefill "
            "instance until its VLLM_NIXL_ABORT_REQUEST_TIMEOUT.",
            registry=registry,
        )
        self.hop_seconds = Histogram(
            "gateway_disaggregated_phase_seconds",
            "A two-hop request's time to first token, by phase: prefill_queue and "
            "decode_queue (in the gateway queue), prefill (sent to the prefill instance "
            "until its answer), decode (sent to the decode instance until the first token: "
            "the KV transfer and its wait there).",
            ["phase"],
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
        Gauge(
            "gateway_build_info",
            "Always 1: the gateway's version and what it runs on, as labels.",
            ["version", "python", "aiohttp"],
            registry=registry,
        ).labels(__version__, platform.python_version(), aiohttp_version).set(1)
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, _resident_memory_bytes...
        # Every series whose labels do not depend on the fleet exists at 0 from the start.
        for reason in CONNECTION_CUTS:
            self.client_connections_closed.labels(reason)
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for why in RETRY_REFUSALS:
            self.retries_refused.labels(why)
        for reason in REJECTIONS:
            self.rejections.labels(reason)
        for side in STREAM_ABORT_SIDES:
            self.stream_aborts.labels(side)
        for path in HOP_PATHS:
            self.hops.labels(path)
        for reason in FALLBACK_REASONS:
            self.hop_fallbacks.labels(reason)
        for phase in HOP_PHASES:
            self.hop_seconds.labels(phase)
        for lane in self.lane_names.values():
            self.duration.labels(lane)
            for priority in PRIORITIES:
                self.queue_wait.labels(lane, priority)
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
        self.config_info = Gauge(
            "gateway_config_info",
            "1, labelled with the digest of the configuration this process serves: workers or "
            "replicas that show different digests serve different configurations.",
            ["hash"],
            registry=registry,
        )

    def depart(self, gone: Iterable[str], present: Iterable[str], grace: float) -> None:
        """Instances left the fleet (a reload, discovery): their series go now, and again
        once `grace` seconds have passed (`sweep`), since a request still on one counts
        when it ends; one back in the fleet keeps its series from now on."""
        now = time.monotonic()
        for server in gone:
            self.forget_server(server)
            self._departed[server] = now + grace
        for server in present:
            self._departed.pop(server, None)

    def sweep(self) -> None:
        """Forget, for good, the departed instances whose last request has ended by now."""
        now = time.monotonic()
        for server, until in list(self._departed.items()):
            if now >= until:
                self.forget_server(server)
                del self._departed[server]

    def forget_server(self, server: str) -> None:
        """An instance left the fleet: its series go with it, so a fleet whose pods come
        and go does not grow the exposition without end."""
        by_server: list[tuple[Counter | Histogram, tuple[str, ...]]] = [
            (self.instance_requests, ("server", "status")),
            (self.instance_errors, ("server", "kind")),
            (self.probe_failures, ("server", "check", "reason")),
            (self.taken_back, ("server",)),
            (self.slo, ("lane", "server", "objective", "result", "priority")),
            (self.goodput, ("lane", "server", "priority")),
            (self.ttft, ("lane", "server")),
            (self.tpot, ("lane", "server")),
        ]
        for metric, names in by_server:
            children = {
                tuple(sample.labels[n] for n in names)
                for family in metric.collect()
                for sample in family.samples
                if sample.labels.get("server") == server
            }
            for labels in children:
                metric.remove(*labels)

    def serving(self, digest: str) -> None:
        """The configuration served now is the one whose digest this is."""
        self.config_info.clear()
        self.config_info.labels(digest).set(1)

    def start_series(
        self,
        servers: Sequence[str],
        *,
        placed_routes: Iterable[str] = (),
        keyed_routes: Iterable[str] = (),
        models: Iterable[str] = (),
        tag: str = "",
        keys: Iterable[str] = (),
    ) -> None:
        """Create at zero the series whose labels the fleet, the routes and the keys decide.

        Per server: its answers by status (200 and the retryable ones), its error kinds, and
        TTFT, TPOT, SLO and goodput for each lane. Per route: 401 for each route that takes
        a key, 404 for unknown paths ('other'), and for each route that places requests in a
        lane, the statuses of PLACED_STATUSES by lane for each model known now (or none).
        Per key: its outcomes and token kinds for each model known now.
        """
        lanes = list(self.lane_names.values())
        for server in servers:
            for status in INSTANCE_STATUSES:
                self.instance_requests.labels(server, status)
            for kind in ERROR_KINDS:
                self.instance_errors.labels(server, kind)
            for lane in lanes:
                self.ttft.labels(lane, server)
                self.tpot.labels(lane, server)
                for priority in PRIORITIES:
                    self.goodput.labels(lane, server, priority)
                    for objective in ("ttft", "tpot"):
                        for result in ("met", "missed"):
                            self.slo.labels(lane, server, objective, result, priority)
        self.requests.labels("other", "404", NONE, NONE, NONE)
        for route in keyed_routes:
            self.requests.labels(route, "401", NONE, NONE, NONE)
        tag_label = self.tag_label(tag or NONE)
        self._pinned.add(tag_label)
        known_models = list(models) or [NONE]
        for key in keys:
            for model in known_models:
                for outcome in KEY_OUTCOMES:
                    self.key_requests.labels(key, model, outcome)
                for kind in TOKEN_KINDS:
                    self.key_tokens.labels(key, model, kind)
        for route in placed_routes:
            for lane in lanes:
                for model in known_models:
                    for status in PLACED_STATUSES:
                        self.requests.labels(route, status, lane, model, tag_label)

    def tag_label(self, tag: str, *, reached: bool = True, now: float = 0.0) -> str:
        """The tag itself if it holds one of `max_tags` slots, else 'other'.

        Only a request that `reached` an instance takes a free slot (a bogus model or path
        must not use them up); a slot idle for TAG_IDLE_S is freed for a new tag.
        """
        if tag in self._tags:
            del self._tags[tag]
            self._tags[tag] = now  # the most recent, last
            return tag
        if not reached:
            return OTHER_TAG
        if len(self._tags) >= self.max_tags:
            self._free_idle_tag(now)
        if len(self._tags) < self.max_tags:
            self._tags[tag] = now
            return tag
        return OTHER_TAG

    def _free_idle_tag(self, now: float) -> None:
        for tag, seen in self._tags.items():  # least recent first
            if tag in self._pinned:
                continue
            if now - seen < TAG_IDLE_S:
                return
            del self._tags[tag]
            for key in [k for k in self._request_series if k[-1] == tag]:
                self.requests.remove(*key)
                del self._request_series[key]
            return

    def request_series(
        self, route: str, status: str, lane: str, model: str, tag: str, *, reached: bool, now: float
    ) -> Any:
        """The `gateway_requests` series of one request (its tag label decided here)."""
        key = (route, status, lane, model, self.tag_label(tag, reached=reached, now=now))
        series = self._request_series.get(key)
        if series is None:
            series = self._request_series[key] = self.requests.labels(*key)
        return series

    def watch(self, snapshot: Callable[[], Snapshot]) -> None:
        """Export the scheduler's state, from a snapshot taken at each scrape."""
        self.registry.register(StateCollector(snapshot, self.lane_names))


class StateCollector(Collector):
    """Turns a snapshot of the scheduler (taken when Prometheus scrapes) into gauges."""

    def __init__(self, snapshot: Callable[[], Snapshot], lane_names: dict[Lane, str]) -> None:
        self.snapshot = snapshot
        self.lane_names = lane_names

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        families = {
            "queue_depth": GaugeMetricFamily(
                "gateway_instance_queue_depth",
                "Requests waiting at each instance beyond its running slots: the larger of "
                "the gateway's own count and the instance's fresh vllm:num_requests_waiting.",
                labels=["server"],
            ),
            "inflight": GaugeMetricFamily(
                "gateway_instance_inflight",
                "Requests this gateway has in flight on each instance.",
                labels=["server"],
            ),
            "up": GaugeMetricFamily(
                "gateway_instance_up",
                "1 if the instance takes traffic (probes pass, not ejected), else 0.",
                labels=["server"],
            ),
            "score": GaugeMetricFamily(
                "gateway_instance_score",
                "The least_busy score of each instance (lower takes the next request).",
                labels=["server"],
            ),
            "running": GaugeMetricFamily(
                "gateway_instance_vllm_running",
                "vllm:num_requests_running at the last scrape (NaN if never or stale).",
                labels=["server"],
            ),
            "waiting": GaugeMetricFamily(
                "gateway_instance_vllm_waiting",
                "vllm:num_requests_waiting at the last scrape (NaN if never or stale).",
                labels=["server"],
            ),
            "prefill_rate": GaugeMetricFamily(
                "gateway_instance_prefill_rate_tokens_per_second",
                "Learned prefill throughput of each instance (NaN before any streamed answer).",
                labels=["server"],
            ),
            "tpot": GaugeMetricFamily(
                "gateway_instance_tpot_estimate_seconds",
                "Learned time per output token of each instance (NaN before any).",
                labels=["server"],
            ),
            "slow": GaugeMetricFamily(
                "gateway_instance_slow",
                "1 while the instance's learned speed is well below the fleet median.",
                labels=["server"],
            ),
            "slots": GaugeMetricFamily(
                "gateway_instance_slots",
                "Running slots the gateway places by: the configured max_num_seqs, or fewer "
                "once the instance showed it runs fewer (requests waiting there twice while "
                "its running count stayed put).",
                labels=["server"],
            ),
            "kv": GaugeMetricFamily(
                "gateway_instance_vllm_kv_cache_usage_ratio",
                "vllm:kv_cache_usage_perc at the last scrape, 0..1 (NaN if unknown).",
                labels=["server"],
            ),
            "scrape_age": GaugeMetricFamily(
                "gateway_instance_scrape_age_seconds",
                "Seconds since the instance's /metrics was last read (+Inf before the first "
                "read): past the staleness limit its load is unknown and dispatch counts it "
                "busy.",
                labels=["server"],
            ),
        }
        prefix: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "index": GaugeMetricFamily(
                "gateway_prefix_index_blocks",
                "Prompt blocks (64 tokens) the gateway remembers sending to each instance.",
                labels=["server"],
            ),
            "queries": CounterMetricFamily(
                "gateway_prefix_query_tokens",
                "Prompt tokens sent to each instance with a prefix estimate.",
                labels=["server"],
            ),
            "hits": CounterMetricFamily(
                "gateway_prefix_estimated_hit_tokens",
                "Of those, the tokens the gateway estimated were in the instance's prefix cache.",
                labels=["server"],
            ),
            "vllm_queries": CounterMetricFamily(
                "gateway_instance_vllm_prefix_cache_query_tokens",
                "vllm:prefix_cache_queries_total at the instance's last scrape (its own count).",
                labels=["server"],
            ),
            "vllm_hits": CounterMetricFamily(
                "gateway_instance_vllm_prefix_cache_hit_tokens",
                "vllm:prefix_cache_hits_total at the instance's last scrape (its own count).",
                labels=["server"],
            ),
        }
        lanes_served = GaugeMetricFamily(
            "gateway_instance_lane",
            "1 for each lane the instance serves (both on a shared instance), 0 for the other.",
            labels=["server", "lane"],
        )
        ejections = CounterMetricFamily(
            "gateway_instance_ejections",
            "Passive ejections of each instance after consecutive failures.",
            labels=["server"],
        )
        nan, inf = float("nan"), float("inf")
        for state in snap.instances:
            name = [state.name]
            report = state.fresh_report
            families["queue_depth"].add_metric(name, state.queue_depth)
            families["inflight"].add_metric(name, state.inflight)
            families["up"].add_metric(name, 1.0 if state.available else 0.0)
            families["score"].add_metric(name, state.score)
            families["running"].add_metric(name, report.running if report else nan)
            families["waiting"].add_metric(name, report.waiting if report else nan)
            kv = report.kv_usage if report else None
            families["kv"].add_metric(name, nan if kv is None else kv)
            last = state.report  # however old: a scrape that keeps failing ages it
            age = inf if last is None else max(0.0, snap.at - last.at)
            families["scrape_age"].add_metric(name, age)
            learned = state.learned_slots
            slots = state.slots if learned is None else min(learned, state.slots)
            families["slots"].add_metric(name, slots)
            ejections.add_metric(name, state.ejections_total)
            for lane in Lane:
                on = state.lane in (lane.value, "any")
                lanes_served.add_metric([state.name, self.lane_names[lane]], 1.0 if on else 0.0)
            rate, tpot = state.prefill_rate, state.tpot
            families["prefill_rate"].add_metric(name, nan if rate is None else rate)
            families["tpot"].add_metric(name, nan if tpot is None else tpot)
            families["slow"].add_metric(name, 1.0 if state.slow else 0.0)
            prefix["index"].add_metric(name, state.prefix_index_blocks)
            prefix["queries"].add_metric(name, state.prefix_query_tokens)
            prefix["hits"].add_metric(name, state.prefix_hit_tokens)
            # The instance's own counters, however old the scrape.
            if last is not None and last.prefix_queries is not None:
                prefix["vllm_queries"].add_metric(name, last.prefix_queries)
            if last is not None and last.prefix_hits is not None:
                prefix["vllm_hits"].add_metric(name, last.prefix_hits)
        yield from families.values()
        yield from prefix.values()
        yield ejections
        yield lanes_served
        yield from _kv_families(snap)
        lanes = GaugeMetricFamily(
            "gateway_queue_depth",
            "Requests waiting in the gateway queue, by lane.",
            labels=["lane"],
        )
        for lane in Lane:
            lanes.add_metric([self.lane_names[lane]], snap.queues[lane])
        yield lanes
        # Keys are the configured ones (named, and "default"): a bounded label.
        service = CounterMetricFamily(
            "gateway_key_service",
            "Weighted tokens served per key, as fair share counts them (prompt 1, output 2).",
            labels=["key"],
        )
        for key, tokens in sorted(snap.key_service.items()):
            service.add_metric([key], tokens)
        yield service
        queued = GaugeMetricFamily(
            "gateway_key_queue_depth",
            "Requests waiting in the gateway queue, by key.",
            labels=["key"],
        )
        for key in sorted(snap.key_service.keys() | snap.key_queued.keys()):
            queued.add_metric([key], snap.key_queued.get(key, 0))
        yield queued
        saturation = GaugeMetricFamily(
            "gateway_fleet_saturation",
            "Per model: requests waiting in the gateway plus those running or waiting at the "
            "instances that serve it, over those instances' running slots (up ones only; "
            "+Inf if none is up while requests wait). Above 1: more demand than slots.",
            labels=["model"],
        )
        for model, value in fleet_saturation(snap).items():
            saturation.add_metric([model], value)
        yield saturation


def _kv_families(snap: Snapshot) -> Iterator[Metric]:
    """The KV events indexes (dispatch/kv_index.py), for instances that publish events."""
    state = GaugeMetricFamily(
        "gateway_kv_index_state",
        "1 for the state of each instance's KV events index: whole (exact), partial (exact "
        "where it holds a block, estimated elsewhere), stale or waiting (estimated only).",
        labels=["server", "state"],
    )
    blocks = GaugeMetricFamily(
        "gateway_kv_index_blocks",
        "Blocks each instance's KV events say its prefix cache holds now.",
        labels=["server"],
    )
    counters = {
        "batches_total": ("gateway_kv_event_batches", "KV event batches applied."),
        "events_total": ("gateway_kv_events", "KV events applied."),
        "gaps_total": ("gateway_kv_event_gaps", "Gaps in an instance's KV event sequence."),
        "replays_total": ("gateway_kv_event_replays", "Replays asked of an instance."),
        "replays_failed_total": (
            "gateway_kv_event_replay_failures",
            "Replays that did not bring every missing batch (the index went partial).",
        ),
        "stale_total": (
            "gateway_kv_index_stale",
            "Times an instance's events stopped for a health interval (the index was emptied).",
        ),
    }
    families = {
        attr: CounterMetricFamily(name, text, labels=["server"])
        for attr, (name, text) in counters.items()
    }
    for instance in snap.instances:
        kv = instance.kv
        if kv is None:
            continue
        for value in KvState:
            state.add_metric([instance.name, value.value], 1.0 if kv.state == value.value else 0.0)
        blocks.add_metric([instance.name], kv.blocks)
        for attr, family in families.items():
            family.add_metric([instance.name], getattr(kv, attr))
    yield state
    yield blocks
    yield from families.values()
