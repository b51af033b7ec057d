"""What the configuration makes of the fleet: the core's inputs, the proxy's endpoints,
the prober's targets and where KV events are heard; built at start and on each reload."""

from __future__ import annotations

import os
from collections.abc import Sequence
from urllib.parse import urlsplit

from gateway.config.load import Config
from gateway.config.schema import InstanceConfig
from gateway.dispatch import HealthPolicy, InstanceSpec, Limits
from gateway.dispatch.affinity import DEFAULT_INDEX_BLOCKS
from gateway.fleet.kv_events import KvSource
from gateway.fleet.probes import ProbeTarget
from gateway.upstream.endpoint import Endpoint


def _instance_headers(config: Config, api_key_env: str | None) -> dict[str, str]:
    headers = {k: v for k, v in config.channel.headers.items() if k.lower() not in _NEVER_FORWARD}
    headers["Content-Type"] = "application/json"
    if api_key_env:
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    return headers


_NEVER_FORWARD = frozenset({"authorization", "host", "content-length", "x-request-tag"})

# A scrape older than this many health rounds counts as unknown, not idle: a round or
# two may be late without an instance's load being forgotten (docs/decisions/0017).
METRICS_STALE_ROUNDS = 3

# With named keys, what an instance may hold waiting beyond its running slots unless
# `max_queue_per_instance` is set: an instance's queue is first come, first served, so
# the queue must wait in the gateway to be shared fairly between keys. None: a calm key
# then waits for one free slot, not for the requests queued at every instance (2 each
# measured worse: docs/decisions/0020-fair-share-queue-at-instances.md).
FAIR_QUEUE_PER_INSTANCE = 0

# The least a place freed here waits for another process's lower-count key: a push, the
# peer's placement and its push back take a Redis round trip or two each.
PEER_YIELD_FLOOR = 0.05
# The most: slow pushes or rounds would otherwise idle a freed place for seconds.
PEER_YIELD_CEILING = 0.5


def queue_per_instance(config: Config) -> int:
    """`max_queue_per_instance` as set, or its default: with named keys, the fair one."""
    dispatch = config.dispatch
    if "max_queue_per_instance" in dispatch.model_fields_set or not config.named_keys:
        return dispatch.max_queue_per_instance
    return min(dispatch.max_queue_per_instance, FAIR_QUEUE_PER_INSTANCE)


def peer_yield(config: Config) -> float:
    """How long a place freed here waits for another process's lower-count key (fairness):
    with named keys and a shared view, long enough for the peer to hear of the place and
    take it (our push, its placement and its push back: a few push intervals, or two rounds
    without pushes); otherwise never (one process, or one key, has nobody to leave it to)."""
    shared = config.file.shared
    if shared.redis_url is None or not config.named_keys:
        return 0.0
    wait = 2 * shared.publish_interval if shared.push_interval == 0 else 5 * shared.push_interval
    return min(PEER_YIELD_CEILING, max(PEER_YIELD_FLOOR, wait))


def scheduler_inputs(
    config: Config, instances: Sequence[InstanceConfig] | None = None
) -> tuple[list[InstanceSpec], Limits, HealthPolicy]:
    """What the pure scheduler is built from (at start, and again on each reload or change
    of the discovered instances): `instances`, by default the configured ones."""
    dispatch = config.dispatch
    specs = [
        InstanceSpec(
            name=i.label,
            lane=i.lane,
            weight=i.weight,
            slots=i.max_num_seqs or dispatch.max_num_seqs,
            models=frozenset(i.models) if i.models is not None else None,
            role=i.role,
            kv_events=i.kv_events is not None,
        )
        for i in (config.instances if instances is None else instances)
    ]
    limits = Limits(
        max_queue_per_instance=queue_per_instance(config),
        max_long_per_instance=config.prefill.max_long_per_instance,
        gateway_queue_size=dispatch.gateway_queue_size,
        global_limit=config.gateway.max_connections,
        metrics_stale_after=METRICS_STALE_ROUNDS * dispatch.health_check_interval,
        queue_retry_after=retry_after_503(config),
        max_queue_wait_short=dispatch.max_queue_wait or config.file.slo.ttft,
        max_queue_wait_long=dispatch.max_queue_wait or config.file.slo.long_ttft,
        # Never shorter than the interactive class's: batch would go first.
        batch_queue_wait_short=max(dispatch.max_queue_wait or 0.0, config.file.slo.batch.ttft),
        batch_queue_wait_long=max(dispatch.max_queue_wait or 0.0, config.file.slo.batch.long_ttft),
        long_input_threshold=config.prefill.long_input_threshold,
        prefix_index_blocks=DEFAULT_INDEX_BLOCKS
        if dispatch.prefix_index_blocks is None
        else dispatch.prefix_index_blocks,
        prefix_index_learned=dispatch.prefix_index_blocks is None,
        shares={k.entry.name: k.entry.share for k in config.named_keys},
        peer_yield=peer_yield(config),
    )
    h = dispatch.health
    # Ejection's length and share are the core's (10 s doubling to 300 s, half the
    # fleet): no measurement here ever varied them (docs/decisions/0017).
    policy = HealthPolicy(rise=h.rise, fall=h.fall, eject_after_failures=h.eject_after_failures)
    return specs, limits, policy


def endpoints_of(
    config: Config, instances: Sequence[InstanceConfig] | None = None
) -> dict[str, Endpoint]:
    """Each instance (by default the configured ones) as the proxy sends to it, by name."""
    return {
        i.label: Endpoint(
            i.label,
            i.url,
            _instance_headers(config, i.api_key_env),
            priority_scheduling=i.scheduling_policy == "priority",
        )
        for i in (config.instances if instances is None else instances)
    }


def kv_sources(
    config: Config, instances: Sequence[InstanceConfig] | None = None
) -> dict[str, KvSource]:
    """Where each instance that publishes KV events does, by name; a `*` host (where vLLM
    binds) is the instance's own host."""
    out = {}
    for i in config.instances if instances is None else instances:
        if i.kv_events is None:
            continue
        host = urlsplit(i.url).hostname or ""
        if ":" in host:
            host = f"[{host}]"
        out[i.label] = KvSource(
            _own_host(i.kv_events.endpoint, host),
            None
            if i.kv_events.replay_endpoint is None
            else _own_host(i.kv_events.replay_endpoint, host),
            i.kv_events.topic,
        )
    return out


def _own_host(endpoint: str, host: str) -> str:
    prefix = "tcp://*:"
    return (
        "tcp://" + host + ":" + endpoint[len(prefix) :] if endpoint.startswith(prefix) else endpoint
    )


def probe_targets(endpoints: dict[str, Endpoint]) -> list[ProbeTarget]:
    return [ProbeTarget(e.name, e.url, _probe_headers(e.headers)) for e in endpoints.values()]


def retry_after_503(config: Config) -> float:
    """The one Retry-After of the gateway's own 503s: about one health round, 1-10 s."""
    return max(1.0, min(config.dispatch.health_check_interval, 10.0))


def _probe_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k == "Authorization"}
