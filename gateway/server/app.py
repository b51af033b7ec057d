"""Builds the aiohttp application and owns every resource and background task.

Resources (the upstream session, the scheduler, the health task) are created in one
`cleanup_ctx` generator and torn down in reverse order; handlers reach them through
typed `AppKey`s. Nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway import errors
from gateway.config.load import Config
from gateway.config.schema import InstanceConfig
from gateway.config.urls import without_credentials
from gateway.dispatch import STRATEGIES, Lane, Scheduler
from gateway.dispatch.kv_index import KvView
from gateway.dispatch.least_time import LeastTime
from gateway.fleet.discovery import Discovery, Resolver, host_port, system_resolver
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.drains import Drains, UnknownInstance
from gateway.fleet.health import HealthChecker
from gateway.fleet.inputs import endpoints_of, kv_sources, probe_targets, scheduler_inputs
from gateway.fleet.kv_events import KvListeners
from gateway.lifecycle import Lifecycle
from gateway.observe import recorder, request_id
from gateway.observe.metrics import Metrics, Registry
from gateway.observe.peer_metrics import PORTS_ENV, WORKER_HEADER, PeerMetrics
from gateway.proxy import auth, tenants
from gateway.proxy.handler import Proxy, Route
from gateway.proxy.prompt_ids import PromptIds
from gateway.proxy.tokenizer import LocalTokenizer, TokenCounter
from gateway.routes import mount
from gateway.server import middleware, redact, usage
from gateway.upstream.client import Upstream
from gateway.upstream.endpoint import Endpoint

if TYPE_CHECKING:
    from gateway.fleet.shared import SharedState


CONFIG = web.AppKey("config", Config)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
PROXY = web.AppKey("proxy", Proxy)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
HEALTH = web.AppKey("health", HealthChecker)
DRAINS = web.AppKey("drains", Drains)
DISCOVERY = web.AppKey("discovery", Discovery)
KV_LISTENERS = web.AppKey("kv_listeners", KvListeners)
METRICS = web.AppKey("metrics", Metrics)
# redis-py is imported only with `[shared]`: it pulls in OpenTelemetry's SDK where that is
# installed, which a gateway without tracing or sharing should not load.
SHARED: web.AppKey[SharedState] = web.AppKey("shared")
PEERS = web.AppKey("peers", PeerMetrics)


class AdminListener:
    """The admin listener's bound port, once it listens (None: there is none)."""

    port: int | None = None


ADMIN = web.AppKey("admin", AdminListener)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_UNKEYED = ("/healthz", "/readyz", "/metrics")  # probes and scrapes take no key


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
                lambda request: request.app[PROXY].intake.keys, _UNKEYED, tenants.identified
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
    for path, route in mount(config.route_prefixes):
        expect = functools.partial(_expect, api=route.api)
        app.router.add_post(path, _proxied_route(route), expect_handler=expect)
    if os.environ.get(PORTS_ENV):  # set by workers.py in its workers only
        app.cleanup_ctx.append(_peer_metrics)
        app.on_response_prepare.append(_worker_header)
    for prefix in config.route_prefixes:
        app.router.add_get(prefix + "/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/instances", _admin_instances)
    app.router.add_post("/admin/instances/{server}/drain", _admin_drain)
    app.router.add_post("/admin/instances/{server}/resume", _admin_resume)
    app.router.add_get("/admin/config", _admin_config)
    app.router.add_get("/admin/usage", _admin_usage)
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
    upstream = Upstream(config.gateway.max_connections, config.channel.timeout)
    await upstream.start()
    endpoints = endpoints_of(config, instances)
    checker = HealthChecker(
        probe_targets(endpoints),
        upstream,
        dispatcher,
        interval=dispatch.health_check_interval,
        probe_timeout=dispatch.health.probe_timeout,
    )
    keys = tenants.key_checker(config)
    counter = _token_counter(config, upstream, dispatcher, endpoints)
    # Each instance's KV events, where it publishes them: its prefix cache as it is.
    listeners = app[KV_LISTENERS] = KvListeners(
        dispatcher.kv_index, dispatcher.clock, grace=dispatch.health_check_interval
    )
    listeners.follow(kv_sources(config, instances))
    app[METRICS] = metrics
    metrics.serving(config.digest())
    app[DISPATCHER] = dispatcher
    app[DRAINS] = Drains(dispatcher)
    discovery.on_change = functools.partial(apply_instances, app)
    discovery.on_failure = lambda entry: metrics.discovery_failures.labels(entry.label).inc()
    app[HEALTH] = checker
    proxy = app[PROXY] = Proxy(
        config, dispatcher, upstream, metrics, keys, endpoints, counter, app[LIFECYCLE]
    )

    def instance_of(model: str | None) -> tuple[str, dict[str, str]] | None:
        name = dispatcher.least_busy_available(model)
        endpoint = None if name is None else proxy.endpoints.get(name)
        return None if endpoint is None else (endpoint.url, endpoint.headers)

    proxy.prompt_ids = PromptIds(upstream, dispatcher.kv_blocks, instance_of)
    # Verdicts before the first request, so start-up does not send traffic blind.
    await checker.run_round()
    recorder.start_series(
        metrics,
        config,
        app.router.routes(),
        servers=dispatcher.instance_names(),
        keyed=not keys.open,
        models=dispatcher.served_models(),
        keys=[t.name for t in tenants.tenants_of(config)],
    )
    task = asyncio.create_task(checker.run_forever(), name="health-checks")
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
    app[DISPATCHER].reconfigure(specs, limits, policy)
    app[PROXY].know(endpoints)
    app[HEALTH].reconfigure(probe_targets(endpoints), config.dispatch.health.probe_timeout)
    app[KV_LISTENERS].follow(kv_sources(config, instances))
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
    shared.on_drains = app[DRAINS].apply
    limits = SharedLimits(shared, settings.namespace)
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

    def least_loaded_instance() -> tuple[str, dict[str, str]] | None:
        name = dispatcher.least_busy_available()
        if name is None:
            return None
        endpoint = endpoints[name]
        return endpoint.url, endpoint.headers

    return TokenCounter(threshold, upstream=upstream, pick_instance=least_loaded_instance)


def _proxied_route(route: Route) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY].handle(request, route)

    handler.__name__ = f"{route.api}_{route.name.replace('.', '_')}"
    return handler


async def _expect(request: web.Request, api: errors.Api) -> web.StreamResponse | None:
    """`Expect: 100-continue` is answered only once the key and the declared size pass.

    aiohttp's default answers `100 Continue` to anyone, inviting the body of a request
    the gateway will refuse. What this returns is sent as is (middlewares do not run),
    with `Connection: close`: the client may send the body anyway.
    """
    expect = request.headers.get("Expect", "")
    try:
        if expect.lower() != "100-continue":
            raise errors.ExpectationFailed(
                f"Expect {expect[:80]!r} is not supported: only '100-continue' is", param="Expect"
            )
        proxy = request.app[PROXY]
        proxy.intake.authorize(request)
        length = request.content_length
        if length is not None and length > proxy.intake.max_body:
            raise errors.PayloadTooLarge(
                f"the declared body of {length} bytes is larger than the gateway's limit "
                f"of {proxy.intake.max_body} bytes"
            )
    except errors.GatewayError as exc:
        response = exc.response({request_id.HEADER: request_id.of(request)}, api)
        response.force_close()
        prefixes = request.app[CONFIG].route_prefixes
        recorder.record_refusal(request.app[PROXY], request, response, prefixes)
        return response
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not started
    return None


async def _models(request: web.Request) -> web.StreamResponse:
    dispatcher = request.app[DISPATCHER]
    up = dispatcher.snapshot().up()
    if not up:
        raise errors.NoInstanceAvailable(
            "no vLLM instance is up", retry_after=dispatcher.retry_after
        )
    data = request.app[HEALTH].model_union({i.name for i in up})
    listed = {m["id"] for m in data}
    for instance in up:  # pinned models of instances that hide the route
        if instance.pinned_models is not None:
            for model in sorted(instance.pinned_models - listed):
                data.append({"id": model, "object": "model", "owned_by": "vllm"})
                listed.add(model)
    allowed = request.get(tenants.TENANT, tenants.DEFAULT).models
    if allowed is not None:  # a key sees only the models it may use, as OpenAI lists them
        data = [m for m in data if m["id"] in allowed]
    # The list is the union of the instances' own: each of them answered it, in part.
    instances = ", ".join(i.name for i in up)
    return web.json_response(
        {"object": "list", "data": data}, headers={"X-Gateway-Instance": instances}
    )


async def _healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.StreamResponse:
    """Ready: not draining and, with `readiness = "fleet"`, an instance up (read per probe:
    a reload changes it)."""
    up = len(request.app[DISPATCHER].snapshot().up())
    draining = request.app[LIFECYCLE].draining
    readiness = request.app[PROXY].config.gateway.readiness
    ready = not draining and (up > 0 or readiness == "process")
    body = {"ready": ready, "instances_up": up, "draining": draining, "readiness": readiness}
    return web.json_response(body, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.StreamResponse:
    peers = request.app.get(PEERS)
    if peers is not None:
        data = await peers.exposition()
    else:
        data = generate_latest(request.app[METRICS].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _admin_config(request: web.Request) -> web.StreamResponse:
    """The configuration running now (nginx -T, Envoy's /config_dump), secrets redacted:
    both files as validated, their digest, when they were loaded and any setting a reload
    read but left for a restart."""
    proxy = request.app[PROXY]
    config = proxy.config
    body = {
        "digest": config.digest(),
        "loaded_at": proxy.loaded_at,
        "config_path": config.config_path,
        "settings_path": config.settings_path,
        "waiting_for_restart": proxy.waiting_for_restart,
        "keys": len(config.api_keys) + len(config.named_keys),
    }
    body["config"], body["settings"] = redact.config_dump(config)  # server/redact.py
    return web.json_response(body)


async def _admin_usage(request: web.Request) -> web.StreamResponse:
    """Each key's use since start (every worker's with --workers), its limits and what is
    left of them now (server/usage.py)."""
    proxy = request.app[PROXY]
    peers = request.app.get(PEERS)
    if peers is not None:
        text = (await peers.exposition()).decode()
        families = list(text_string_to_metric_families(text))
    else:
        families = list(request.app[METRICS].registry.collect())
    configured = tenants.tenants_of(proxy.config)
    standings = {t.name: await proxy.limiter.standings(t) for t in configured if t.limits.any}
    body = usage.report(configured, families, standings)
    return web.Response(text=json.dumps(body, indent=2), content_type="application/json")


async def _admin_drain(request: web.Request) -> web.StreamResponse:
    return await _drain_order(request, drained=True)


async def _admin_resume(request: web.Request) -> web.StreamResponse:
    return await _drain_order(request, drained=False)


async def _drain_order(request: web.Request, *, drained: bool) -> web.StreamResponse:
    """Take `{server}` out of rotation or back in (fleet/drains.py); idempotent."""
    name = request.match_info["server"]
    try:
        order = await request.app[DRAINS].order(name, drained)
    except UnknownInstance:
        known = sorted(request.app[DISPATCHER].instance_names())
        raise errors.InstanceNotFound(
            f"no instance named {name!r}: the fleet holds {known} (GET /admin/instances)",
            param="server",
        ) from None
    if order is None:
        raise errors.SharedStoreUnavailable(
            "the shared store (Redis) did not take the order, so no replica applies it: "
            "nothing changed; try again"
        )
    since = order.since
    body = {
        "name": name,
        "drained": since is not None,
        "drained_since": None if since is None else _iso(since),
        "fleet_wide": request.app[DRAINS].store is not None,
    }
    return web.json_response(body)


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat(timespec="seconds")


def _kv_view(kv: KvView, wall: float) -> dict[str, Any]:
    """An instance's KV events index: whether dispatch reads its cache from it, and why."""
    age = kv.last_event_age
    return {
        "index": kv.state,  # whole | partial | stale | waiting (kv_index.py)
        "blocks": kv.blocks,
        "block_size": kv.block_size,
        "next_seq": kv.next_seq,
        "last_event_at": None if age is None else _iso(wall - age),
        "batches_total": kv.batches_total,
        "events_total": kv.events_total,
        "gaps_total": kv.gaps_total,
        "replays_total": kv.replays_total,
        "replays_failed_total": kv.replays_failed_total,
        "malformed_total": kv.malformed_total,
        "unchained_blocks_total": kv.unchained_total,
        "stale_total": kv.stale_total,
    }


async def _admin_instances(request: web.Request) -> web.StreamResponse:
    snap = request.app[DISPATCHER].snapshot()
    wall = time.time()  # the snapshot's ages, as times an operator can read
    # The long lane is named by [prefill].tag here too, as in metrics and logs.
    lane_names = {lane.value: name for lane, name in request.app[METRICS].lane_names.items()}
    instances: list[dict[str, Any]] = []
    for i in snap.instances:
        report = i.report
        instances.append(
            {
                "name": i.name,
                "state": i.verdict,
                "state_since": None if i.verdict_for is None else _iso(wall - i.verdict_for),
                "available": i.available,
                "drained": i.drained_since is not None,
                "drained_since": None if i.drained_since is None else _iso(i.drained_since),
                "ejected_for_s": None if i.ejected_for is None else round(i.ejected_for, 1),
                "lane": lane_names.get(i.lane, i.lane),
                "role": i.role,
                "weight": i.weight,
                "slots": i.slots,
                "learned_slots": i.learned_slots,
                "models": None if i.models is None else sorted(i.models),
                "models_pinned": i.pinned_models is not None,
                "prefix_index_blocks": i.prefix_index_blocks,
                "prefix_estimated_hit_ratio": round(i.prefix_hit_tokens / i.prefix_query_tokens, 4)
                if i.prefix_query_tokens
                else None,
                "inflight": i.inflight,
                "peers_inflight": i.peers_inflight,
                "peers_pending_prefill_tokens": i.peers_pending_prefill_tokens,
                "long_prefilling": i.long_prefilling,
                "queue_depth": i.queue_depth,
                "score": round(i.score, 4),
                "load_fresh": i.load_fresh,
                "vllm": None
                if report is None
                else {
                    "running": report.running,
                    "waiting": report.waiting,
                    "kv_cache_usage": report.kv_usage,
                    "age_s": round(snap.at - report.at, 1),
                },
                "assigned_total": i.assigned_total,
                "failures_total": i.failures_total,
                "consecutive_failures": i.consecutive_failures,
                "probe_failures_total": i.probe_failures_total,
                "consecutive_probe_failures": i.consecutive_probe_failures,
                "ejections_total": i.ejections_total,
                "recent_errors": [
                    {"at": _iso(wall - ago), "error": error} for ago, error in i.recent_errors
                ],
                "kv_events": None if i.kv is None else _kv_view(i.kv, wall),
            }
        )
    queues = {lane_names[lane.value]: n for lane, n in snap.queues.items()}
    discovery = request.app[DISCOVERY]
    body = {
        "strategy": snap.strategy,
        "inflight": snap.inflight,
        "instances": instances,
        "queues": queues,
        "discovery": [
            {
                "entry": without_credentials(entry.url),
                "addresses": [host_port(a) for a in state.addresses],
                "resolved_at": None if state.resolved_at is None else _iso(state.resolved_at),
                "empty_answers_in_a_row": state.empty_rounds,
                "error": state.error,
                "failing_since": None if state.failing_since is None else _iso(state.failing_since),
                "failures_total": state.failures_total,
            }
            for entry, state in discovery.entry_states()
        ],
    }
    return web.Response(text=json.dumps(body, indent=2), content_type="application/json")
