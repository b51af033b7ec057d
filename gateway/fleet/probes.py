"""Active health: probe each instance's `/health`, scrape its `/metrics` and `/v1/models`.

One background task, owned by the app, runs a round every `health_check_interval`
(jittered by +-10% so a fleet of gateways does not probe in step). A round probes all
instances concurrently; verdicts go to the scheduler through the dispatcher.

Between rounds, an instance that holds more of our requests than it ever showed running
has its metrics read twice, `LOOK_GAP_S` apart (`scrape_soon`): two readings are what it
takes to learn that it runs fewer than configured (dispatch/instances.py, `learned_slots`), and
a flood should not wait for the next round to find out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.config.load import Config
from gateway.fleet.dispatcher import Dispatcher
from gateway.observe import log
from gateway.upstream.client import Upstream
from gateway.upstream.response import AttemptFailed

_log = log.get("gateway.health")

LOOK_GAP_S = 0.5  # between the two early readings of an instance, and between two looks

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
# Prefix-cache counters, in tokens (the parser strips a counter's _total suffix); older
# vLLM said gpu_prefix_cache_*.
_PREFIX_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_PREFIX_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
# A gauge of value 1 whose labels are the KV cache's size and prefix caching's switch (an
# info-typed exposition would lose its `_info` suffix in the parser: accept both).
_CACHE_CONFIG = ("vllm:cache_config_info", "vllm:cache_config")
# vLLM renamed the KV gauge; accept either so old and new instances both count.
_KV_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True)
class ProbeTarget:
    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class VllmLoad:
    running: float
    waiting: float
    kv_usage: float | None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    # From vllm:cache_config_info: how many tokens its prefix cache can hold at most
    # (0: prefix caching off), or None if it does not say.
    cache_tokens: int | None = None


def parse_vllm_metrics(text: str) -> VllmLoad | None:
    """Sum vLLM's load gauges over `engine` (and any other) labels; None if absent."""
    totals: dict[str, float] = {}
    prefix: dict[str, float] = {}
    cache_tokens: int | None = None
    for family in text_string_to_metric_families(text):
        if family.name in _CACHE_CONFIG:
            for sample in family.samples:
                cache_tokens = _cache_tokens(sample.labels)
            continue
        if family.name in _PREFIX_QUERIES or family.name in _PREFIX_HITS:
            kind = "queries" if family.name in _PREFIX_QUERIES else "hits"
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    prefix[kind] = prefix.get(kind, 0.0) + sample.value
            continue
        for sample in family.samples:
            if sample.name == _RUNNING or sample.name == _WAITING or sample.name in _KV_NAMES:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            # KV usage is a fraction per engine: average it rather than sum.
            if sample.name in _KV_NAMES:
                totals[sample.name + "#n"] = totals.get(sample.name + "#n", 0.0) + 1
    if _RUNNING not in totals and _WAITING not in totals:
        return None
    kv: float | None = None
    for name in _KV_NAMES:
        if name in totals:
            kv = totals[name] / totals[name + "#n"]
            break
    return VllmLoad(
        totals.get(_RUNNING, 0.0),
        totals.get(_WAITING, 0.0),
        kv,
        prefix.get("queries"),
        prefix.get("hits"),
        cache_tokens,
    )


def _cache_tokens(labels: dict[str, str]) -> int | None:
    """Tokens the KV cache holds (num_gpu_blocks x block_size); 0 if prefix caching is off."""
    if labels.get("enable_prefix_caching", "True").lower() == "false":
        return 0
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


class Prober:
    def __init__(
        self,
        targets: list[ProbeTarget],
        upstream: Upstream,
        dispatcher: Dispatcher,
        *,
        interval: float,
        probe_timeout: float,
        rng: random.Random | None = None,
    ) -> None:
        self.targets = targets
        self.upstream = upstream
        self.dispatcher = dispatcher
        self.interval = interval
        self.probe_timeout = probe_timeout
        self.rng = rng or random.Random()
        self.models: dict[str, list[dict[str, Any]]] = {}
        self.rounds = 0
        self._wake = asyncio.Event()
        self._looks: dict[str, asyncio.Task[None]] = {}  # early readings under way
        self._scrape_failing: set[str] = set()  # whose last scrape failed (logged once)
        dispatcher.on_unconfirmed = self.scrape_soon

    def apply(self, config: Config, targets: list[ProbeTarget]) -> None:
        """A reloaded configuration (`dispatch.health.probe_timeout`) and instance list:
        probe it now, so new instances get a verdict soon. The instance list comes as its
        probe targets (fleet/inputs.py), not from `config`: discovery's instances are in
        no file. The interval is fixed at start."""
        self.targets = targets
        self.probe_timeout = config.dispatch.health.probe_timeout
        names = {t.name for t in targets}
        self.models = {k: v for k, v in self.models.items() if k in names}
        self._wake.set()

    async def run_round(self) -> None:
        await asyncio.gather(*(self._check(t) for t in self.targets))
        self.rounds += 1
        self.dispatcher.metrics.sweep()  # series of instances gone long enough
        flags = self.dispatcher.update_slow_flags()
        self.dispatcher.place_waiting()
        if not flags:
            return
        snap = {i.name: i for i in self.dispatcher.snapshot().instances}
        for name, slow in flags.items():
            _log.warning(
                "instance_slow" if slow else "instance_speed_recovered",
                server=name,
                prefill_tokens_per_s=snap[name].prefill_rate,
                tpot_s=snap[name].tpot,
            )

    async def run_forever(self) -> None:
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval * self.rng.uniform(0.9, 1.1)):
                        await self._wake.wait()
                self._wake.clear()
                try:
                    await self.run_round()
                except Exception as exc:  # a bad round must not end health checking for good
                    _log.error("health_round_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            for look in self._looks.values():
                look.cancel()
            await asyncio.gather(*self._looks.values(), return_exceptions=True)

    def scrape_soon(self, name: str) -> None:
        """Read `name`'s metrics now and once more in LOOK_GAP_S (once at a time)."""
        target = next((t for t in self.targets if t.name == name), None)
        if target is None or name in self._looks:
            return
        self._looks[name] = asyncio.get_running_loop().create_task(self._look(target))

    async def _look(self, target: ProbeTarget) -> None:
        try:
            for _ in range(2):
                await self._scrape(target)
                await asyncio.sleep(LOOK_GAP_S)
        finally:
            self._looks.pop(target.name, None)

    async def _check(self, target: ProbeTarget) -> None:
        failed = await self._probe(target)
        ok = failed is None
        if failed is not None:
            self.dispatcher.metrics.probe_failures.labels(target.name, "probe", failed).inc()
        if self.dispatcher.probe(target.name, ok, None if ok else f"probe: {failed}"):
            # Coming up is good news (and every start-up's first verdict): info, not warning.
            if ok:
                _log.info("instance_up", server=target.name)
            else:
                _log.warning("instance_down", server=target.name, reason=failed)
        if ok:
            await asyncio.gather(self._scrape(target), self._models(target))

    async def _probe(self, target: ProbeTarget) -> str | None:
        """None if `/health` answered 200, else why not (the kind of failure, or the status)."""
        try:
            status, _ = await self.upstream.fetch(
                target.url + "/health", headers=target.headers, timeout=self.probe_timeout
            )
        except AttemptFailed as exc:
            return exc.reported
        return None if status == 200 else f"status_{status}"

    async def _scrape(self, target: ProbeTarget) -> None:
        failed: str | None = None
        load: VllmLoad | None = None
        try:
            status, body = await self.upstream.fetch(
                target.url + "/metrics", headers=target.headers, timeout=self.probe_timeout
            )
            if status != 200:
                failed = f"status_{status}"
            else:
                load = parse_vllm_metrics(body.decode())
                failed = None if load is not None else "no_vllm_metrics"
        except AttemptFailed as exc:
            failed = exc.reported
        except (ValueError, UnicodeDecodeError):
            failed = "parse"
        if failed is not None:
            # An unknown load counts as the busiest fleet's, so a scrape that keeps failing
            # changes dispatch: counted always, logged when it starts, kept for the operator.
            self.dispatcher.metrics.probe_failures.labels(target.name, "scrape", failed).inc()
            self.dispatcher.observe_error(target.name, f"scrape: {failed}")
            if target.name not in self._scrape_failing:
                self._scrape_failing.add(target.name)
                _log.warning("scrape_failed", server=target.name, reason=failed)
            return
        if target.name in self._scrape_failing:
            self._scrape_failing.discard(target.name)
            _log.info("scrape_recovered", server=target.name)
        assert load is not None
        self.dispatcher.report_load(
            target.name,
            load.running,
            load.waiting,
            load.kv_usage,
            load.prefix_queries,
            load.prefix_hits,
            load.cache_tokens,
        )

    async def _models(self, target: ProbeTarget) -> None:
        try:
            status, body = await self.upstream.fetch(
                target.url + "/v1/models", headers=target.headers, timeout=self.probe_timeout
            )
            data = json.loads(body)["data"] if status == 200 else None
        except (AttemptFailed, ValueError, KeyError, TypeError):
            data = None
        if isinstance(data, list):
            models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
            self.models[target.name] = models
            # LoRA adapters are listed as models too: each id is routable to this instance.
            self.dispatcher.set_models(target.name, frozenset(m["id"] for m in models))

    def model_union(self, up: set[str]) -> list[dict[str, Any]]:
        """The models of the instances that are up, each id once."""
        seen: dict[str, dict[str, Any]] = {}
        for name in (t.name for t in self.targets):
            if name in up:
                for model in self.models.get(name, []):
                    seen.setdefault(model["id"], model)
        return list(seen.values())
