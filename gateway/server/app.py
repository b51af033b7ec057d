"""The composition root: builds the aiohttp application and owns every resource and
background task.

Resources (the upstream session, the scheduler, the health task) are created in one
`cleanup_ctx` generator and torn down in reverse order, and hung on the app under the
typed `AppKey`s of resources.py. Each one a reload changes has its own `apply`: reload.py
calls those the configuration changes, and `apply_instances` (a reload, or discovery) those
the instance list changes.
The routes are the route modules' (api_routes.py, probe_routes.py, admin_routes.py).
Nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gateway.config.load import Config
from gateway.config.schema import InstanceConfig
from gateway.dispatch import STRATEGIES, Lane, Scheduler
from gateway.dispatch.least_time import LeastTime
from gateway.fleet.discovery import Discovery, Resolver, system_resolver
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.drains import Drains
from gateway.fleet.inputs import endpoints_of, kv_sources, probe_targets, scheduler_inputs
from gateway.fleet.kv_events import KvListeners
from gateway.fleet.probes import Prober
from gateway.lifecycle import Lifecycle
from gateway.observe import recorder, request_id
from gateway.observe.metrics import Metrics, Registry
from gateway.observe.peer_metrics import PORTS_ENV, WORKER_HEADER, PeerMetrics
from gateway.proxy import auth, tenants
from gateway.proxy.handler import Proxy
from gateway.proxy.prompt_ids import PromptIds
from gateway.proxy.tokenizer import LocalTokenizer, TokenCounter
from gateway.routes import mount
from gateway.server import admin_routes, api_routes, middleware, probe_routes
from gateway.server.resources import (
    ADMIN,
    CONFIG,
    DISCOVERY,
    DISPATCHER,
    DRAINS,
    KV_LISTENERS,
    LIFECYCLE,
    METRICS,
    PEERS,
    PROBER,
    PROXY,
    SHARED,
    TOKEN_COUNTER,
    UPSTREAM,
    AdminListener,
)
from gateway.upstream.client import Upstream
from gateway.upstream.endpoint import Endpoint


def build_app(
    config: Config, lifecycle: Lifecycle | None = None, *, resolver: Resolver = system_resolver
) -> web.Application:
    """`resolver`: how `"discover": "dns"` entries are resolved (tests inject their own)."""
    app = web.Application(
        client_max_size=config.gateway.max_body_bytes,
        middlewares=[  # the order matters: middleware.py says why
            request_id.middleware(),
            recorder.middleware(lambda app: app[PROXY], config.route_prefixes),
            middleware.shaped_errors(
                {path: route.api for path, route in mount(config.route_prefixes)}
            ),
            middleware.traced(
                lambda request: request.app[PROXY].spans,
                (route.name for _, route in mount(config.route_prefixes)),
            ),
            auth.middleware(
                lambda request: request.app[PROXY].intake.keys,
                probe_routes.UNKEYED,
                tenants.identified,
            ),
        ],
    )
    admin = app[ADMIN] = AdminListener()
    if config.gateway.admin_port is not None:
        # Inside shaped_errors, so the 404 has the route's shape; before the key check, so a
        # route of the other listener says 404 whatever the key.
        app.middlewares.insert(3, middleware.split_listeners(lambda: admin.port))
    app[CONFIG] = config
    app[LIFECYCLE] = lifecycle or Lifecycle()
    app[DISCOVERY] = Discovery(config.instances, config.dispatch.discovery_interval, resolver)
    app.cleanup_ctx.append(_resources)
    if config.file.shared.redis_url is not None:
        app.cleanup_ctx.append(_shared_state)
    if os.environ.get(PORTS_ENV):  # set by workers.py in its workers only
        app.cleanup_ctx.append(_peer_metrics)
        app.on_response_prepare.append(_worker_header)
    api_routes.add_routes(app.router, config.route_prefixes)
    probe_routes.add_routes(app.router)
    admin_routes.add_routes(app.router)
    return app


async def _resources(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    dispatch = config.dispatch
    registry = Registry()
    metrics = Metrics(registry, lane_names={Lane.SHORT: "short", Lane.LONG: config.prefill.tag})
    discovery = app[DISCOVERY]
    if discovery.active:  # the addresses before the first request, as the verdicts
        await discovery.run_round()
    instances = discovery.instances()
    specs, limits, policy = scheduler_inputs(config, instances)
    stale_after = limits.metrics_stale_after
    slo = config.file.slo
    strategy = STRATEGIES[dispatch.strategy](
        stale_after, {Lane.SHORT: slo.tpot, Lane.LONG: slo.long_tpot}
    )
    if isinstance(strategy, LeastTime):
        strategy.ttft_objectives = {Lane.SHORT: slo.ttft, Lane.LONG: slo.long_ttft}
    scheduler = Scheduler(specs, strategy, limits, policy)
    dispatcher = Dispatcher(scheduler, metrics)
    metrics.watch(dispatcher.snapshot)
    upstream = app[UPSTREAM] = Upstream(config.gateway.max_connections, config.channel.timeout)
    await upstream.start()
    endpoints = endpoints_of(config, instances)
    prober = Prober(
        probe_targets(endpoints),
        upstream,
        dispatcher,
        interval=dispatch.health_check_interval,
        probe_timeout=dispatch.health.probe_timeout,
    )
    counter = app[TOKEN_COUNTER] = _token_counter(config, upstream, dispatcher, endpoints)
    # Each instance's KV events, where it publishes them: its prefix cache as it is.
    listeners = app[KV_LISTENERS] = KvListeners(
        dispatcher.kv_index, dispatcher.clock, grace=dispatch.health_check_interval
    )
    listeners.apply(kv_sources(config, instances))
    app[METRICS] = metrics
    metrics.serving(config.digest())
    app[DISPATCHER] = dispatcher
    app[DRAINS] = Drains(dispatcher)
    discovery.on_change = functools.partial(apply_instances, app)
    discovery.on_failure = lambda entry: metrics.discovery_failures.labels(entry.label).inc()
    app[PROBER] = prober
    proxy = app[PROXY] = Proxy(
        config, dispatcher, upstream, metrics, endpoints, counter, app[LIFECYCLE]
    )
    proxy.prompt_ids = PromptIds(
        upstream, dispatcher.kv_blocks, _least_busy_endpoint(dispatcher, endpoints)
    )
    # Verdicts before the first request, so start-up does not send traffic blind.
    await prober.run_round()
    recorder.start_series(
        metrics,
        config,
        app.router.routes(),
        servers=dispatcher.instance_names(),
        keyed=config.keyed,
        models=dispatcher.served_models(),
        keys=[t.name for t in tenants.tenants_of(config)],
    )
    task = asyncio.create_task(prober.run_forever(), name="health-checks")
    finding = asyncio.create_task(discovery.run_forever(), name="discovery")
    try:
        yield
    finally:
        await _stop(finding)
        await _stop(task)
        await listeners.close()
        await upstream.close()


def apply_instances(app: web.Application, instances: list[InstanceConfig]) -> None:
    """A new instance list (a reload, or discovery found others): the scheduler keeps the
    state of those that stay, the proxy learns the new ones' endpoints, the prober probes
    them now; a removed one's requests finish and its per-instance series go."""
    config = app[PROXY].config
    before = app[DISPATCHER].instance_names()
    endpoints = endpoints_of(config, instances)
    specs, limits, policy = scheduler_inputs(config, instances)
    app[DISPATCHER].apply(specs, limits, policy)
    app[PROXY].know(endpoints)
    app[PROBER].apply(config, probe_targets(endpoints))
    app[KV_LISTENERS].apply(kv_sources(config, instances))
    # A removed instance's streams may still end (and count) for up to a request's time.
    app[METRICS].depart(before - set(endpoints), set(endpoints), config.gateway.request_timeout)


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel a background task the app owns and wait for it to end."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _shared_state(app: web.Application) -> AsyncIterator[None]:
    """With `[shared] redis_url`: publish our load and read the other processes' (shared.py),
    and keep the named keys' counters in Redis (shared_limits.py)."""
    from gateway.fleet.shared import SharedState, SharedStateCollector
    from gateway.fleet.shared_limits import SharedLimits

    settings = app[CONFIG].file.shared
    assert settings.redis_url is not None
    shared = SharedState(
        settings.redis_url.get_secret_value(),
        app[DISPATCHER],
        app[PROXY].budget,
        interval=settings.publish_interval,
        ttl=settings.ttl,
        namespace=settings.namespace,
        push_interval=settings.push_interval,
        strict_caps=settings.strict_caps,
    )
    app[SHARED] = shared
    app[METRICS].registry.register(SharedStateCollector(shared))
    # The drains live in Redis: every replica applies them (drains.py).
    app[DRAINS].store = shared.store_drain
    shared.on_drains = app[DRAINS].apply_table
    limits = SharedLimits(shared.link, settings.namespace)
    app[PROXY].limiter.shared = limits
    await shared.run_round()  # join the view before the first request, if Redis answers
    task = asyncio.create_task(shared.run_forever(), name="shared-state")
    settling = asyncio.create_task(limits.run_forever(), name="shared-limits")
    try:
        yield
    finally:
        app[PROXY].limiter.shared = None
        app[DRAINS].store = None
        await _stop(settling)
        await _stop(task)
        await shared.close()


async def _peer_metrics(app: web.Application) -> AsyncIterator[None]:
    """As a worker of `gateway --workers N`: `/metrics` answers for every worker."""
    peers = PeerMetrics.from_environment(app[METRICS].registry)
    assert peers is not None
    await peers.start()
    app[PEERS] = peers
    try:
        yield
    finally:
        await peers.close()


async def _worker_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[WORKER_HEADER] = str(os.getpid())


def _token_counter(
    config: Config, upstream: Upstream, dispatcher: Dispatcher, endpoints: dict[str, Endpoint]
) -> TokenCounter:
    source = config.prefill.tokenizer
    threshold = config.prefill.long_input_threshold
    if source is None:
        return TokenCounter(threshold)
    if source != "instance":
        return TokenCounter(threshold, local=LocalTokenizer(source))
    pick = _least_busy_endpoint(dispatcher, endpoints)
    return TokenCounter(threshold, upstream=upstream, pick_instance=lambda: pick(None))


def _least_busy_endpoint(
    dispatcher: Dispatcher, endpoints: dict[str, Endpoint]
) -> Callable[[str | None], tuple[str, dict[str, str]] | None]:
    """Where a small call a request waits on goes (its /tokenize): the least busy available
    instance (of `model`'s, if named). `endpoints` is the proxy's, which learns new ones."""

    def pick(model: str | None = None) -> tuple[str, dict[str, str]] | None:
        name = dispatcher.least_busy_available(model)
        endpoint = None if name is None else endpoints.get(name)
        return None if endpoint is None else (endpoint.url, endpoint.headers)

    return pick
