"""The simulated instance's /metrics: vLLM's metric names and labels, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from .sim_batching import Engine
from .sim_engine import SimConfig, SimStats
from .sim_kv_transfer import KvConnector


class Observed(Protocol):
    """What the collector reads; the instance swaps its engine and config at run time."""

    config: SimConfig
    stats: SimStats
    engine: Engine
    kv: KvConnector | None


class VllmMetrics:
    """Reads the instance's live state at scrape time, with vLLM's metric names and labels."""

    def __init__(self, sim: Observed) -> None:
        self._sim = sim

    def collect(self) -> Iterable[Metric]:
        sim, stats = self._sim, self._sim.stats
        names, values = ["model_name", "engine"], [sim.config.model, "0"]
        for name, value in [
            ("vllm:num_requests_running", stats.running),
            ("vllm:num_requests_waiting", stats.waiting),
            ("vllm:kv_cache_usage_perc", sim.engine.kv_cache_usage),
        ]:
            gauge = GaugeMetricFamily(name, name.removeprefix("vllm:"), labels=names)
            gauge.add_metric(values, float(value))
            yield gauge
        for name, total in [
            ("vllm:prompt_tokens", stats.prompt_tokens),
            ("vllm:generation_tokens", stats.generation_tokens),
            # vLLM v1's names, counted in tokens (older: vllm:gpu_prefix_cache_*, deprecated).
            ("vllm:prefix_cache_queries", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", stats.prefix_cache_hits),
        ]:
            counter = CounterMetricFamily(name, name.removeprefix("vllm:"), labels=names)
            counter.add_metric(values, float(total))
            yield counter
        # vLLM splits successes by finish reason; every simulated request stops on length.
        success = CounterMetricFamily(
            "vllm:request_success", "request_success", labels=[*names, "finished_reason"]
        )
        success.add_metric([*values, "length"], float(stats.completed))
        yield success
        # vLLM's static cache configuration, as an info gauge: the KV cache's size in blocks
        # and whether prefix caching is on. Only the prefix cache is modelled here, so its
        # blocks stand for the whole cache.
        config = sim.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "num_gpu_blocks"],
        )
        info.add_metric(
            [
                str(config.block_size),
                str(config.prefix_caching),
                str(config.prefix_cache_blocks),
            ],
            1.0,
        )
        yield info
        if sim.kv is not None:
            yield from _kv_metrics(sim.kv, stats, names, values)


def _kv_metrics(
    kv: KvConnector, stats: SimStats, names: list[str], values: list[str]
) -> Iterable[Metric]:
    """The KV connector's state under `sim:` names: vLLM has no such metrics (its NIXL
    transfer stats are another shape), so none may pass for vLLM's."""
    held = GaugeMetricFamily(
        "sim:kv_blocks_held", "KV blocks held for decode instances", labels=names
    )
    held.add_metric(values, float(kv.blocks_held()))  # frees the expired ones first
    yield held
    for name, help_text, total in [
        ("sim:kv_produced", "prefill legs answered with kv_transfer_params", stats.kv_produced),
        ("sim:kv_blocks_expired", "held KV blocks freed unread", stats.kv_blocks_expired),
        ("sim:kv_transfers", "decode legs that read their KV remotely", stats.kv_transfers),
        ("sim:kv_fallbacks", "decode legs prefilled locally instead", stats.kv_fallbacks),
    ]:
        counter = CounterMetricFamily(name, help_text, labels=names)
        counter.add_metric(values, float(total))
        yield counter
