"""After the fact: one access-log line and the metrics of each finished request.

Every request the app answers passes here once, whatever answered it (the proxy, another
route, or the error middleware for 401, 404, 405 and 413): the middleware opens its
`Exchange` with `begin()`, the handler fills it in, and the middleware calls `record()`.

Also the SLO accounting: a finished stream is counted against its lane's objectives for
time to first token and time per output token, and as goodput when it met both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.config.load import Config
from gateway.observe import log, request_id
from gateway.observe.client_address import Network, client_of, networks
from gateway.observe.exchange import Exchange, tokens_used
from gateway.observe.metrics import NONE, REJECTIONS, Metrics

_access = log.get("gateway.access")

EXCHANGE = web.RequestKey("exchange", Exchange)
OTHER_ROUTE = "other"
# Probes and scrapes: they take no key, and their successes log at debug only (they are
# answered often and uneventfully).
PROBE_ROUTES = frozenset({"healthz", "readyz", "metrics"})
_USER_AGENT_CHARS = 200
_PATH_CHARS = 200


def route_label(path: str, prefixes: Sequence[str]) -> str:
    """A route's name from its path: the OpenAI prefix off, slashes as dots.

    "/v1/chat/completions" -> "chat.completions", "/admin/instances" -> "admin.instances".
    Only paths of registered routes are passed in, so the names are bounded.
    """
    for prefix in sorted(prefixes, key=len, reverse=True):
        if prefix and path.startswith(prefix + "/"):
            path = path[len(prefix) :]
            break
    return path.strip("/").replace("/", ".") or OTHER_ROUTE


def route_of(request: web.Request, prefixes: Sequence[str]) -> str:
    """The bounded route name of a request: its route's, else 'other' (no route has the path)."""
    resource = request.match_info.route.resource
    if resource is not None:
        return route_label(resource.canonical, prefixes)
    if request.match_info.http_exception is not None:  # 405: a route has this path
        for known in request.app.router.resources():
            if known.canonical == request.path:
                return route_label(known.canonical, prefixes)
    return OTHER_ROUTE


def route_table(
    routes: Iterable[web.AbstractRoute], prefixes: Sequence[str]
) -> dict[str, set[str]]:
    """Each route's name and the methods it takes."""
    table: dict[str, set[str]] = {}
    for route in routes:
        if route.resource is not None:
            name = route_label(route.resource.canonical, prefixes)
            table.setdefault(name, set()).add(route.method)
    return table


def start_series(
    metrics: Metrics,
    config: Config,
    routes: Iterable[web.AbstractRoute],
    *,
    servers: Iterable[str],
    keyed: bool,
    models: Iterable[str],
    keys: Iterable[str] = (),
) -> None:
    """Create the series known at start at zero: POST routes place requests in a lane,
    (with `keyed`) every route but the probes and /metrics can answer 401, and each of
    `keys` (the keys' names) has its outcomes and tokens."""
    table = route_table(routes, config.route_prefixes)
    metrics.start_series(
        list(servers),
        placed_routes=[r for r, methods in table.items() if "POST" in methods],
        keyed_routes=[r for r in table if r not in PROBE_ROUTES] if keyed else [],
        models=models,
        tag=config.channel.headers.get("X-Request-Tag", ""),
        keys=keys,
    )


def key_outcome(ex: Exchange) -> str:
    """What became of a key's request, as `gateway_key_requests_total` counts it: turned
    away by the gateway itself (`refused`: the fleet is full, not the client wrong), by the
    key's own model list or limits, or answered."""
    if ex.refused in REJECTIONS:
        return "refused"
    if ex.refused:
        return "denied" if ex.refused == "model" else f"limit_{ex.refused}"
    if ex.status == 499 or ex.cut:
        return "cut"
    return "ok" if ex.status < 400 else "error"


class Owner(Protocol):
    """What recording needs from the app: the recorder and the request clock (the proxy)."""

    @property
    def recorder(self) -> Recorder: ...

    @property
    def clock(self) -> Callable[[], float]: ...


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(owner: Callable[[web.Application], Owner], prefixes: Sequence[str]) -> Middleware:
    """The middleware that records every request, whatever answers it.

    It sits outside the one that shapes errors, so it sees the 401, 404, 405 and 413
    answers as the client gets them; the proxy fills in the Exchange opened here.
    """

    names: dict[str, str] = {}  # each route's name, worked out once per route

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        own = owner(request.app)
        resource = request.match_info.route.resource
        name = names.get(resource.canonical) if resource is not None else None
        if name is None:
            name = route_of(request, prefixes)
            if resource is not None:
                names[resource.canonical] = name
        ex = own.recorder.begin(request, name, own.clock())
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            return response
        except asyncio.CancelledError:
            ex.status = ex.status or 499  # the client closed the connection (nginx's code)
            raise
        except web.HTTPException as exc:  # one aiohttp answers itself
            ex.status = ex.status or exc.status
            raise
        except Exception:
            ex.status = ex.status or 500
            raise
        finally:
            if response is not None:
                ex.status = ex.status or response.status
                ex.bytes_sent = bytes_of(response)
            own.recorder.record(ex, own.clock() - ex.started)

    return record


def bytes_of(response: web.StreamResponse) -> int:
    """The answer's body bytes, without its head or any chunk framing: a stream counts what
    it wrote (the relay's `ClientStream`: also when cut short), a whole answer, not written yet, is
    its Content-Length."""
    return response.body_length if response.prepared else response.content_length or 0


def record_refusal(
    owner: Owner, request: web.Request, response: web.Response, prefixes: Sequence[str]
) -> None:
    """Count and log an `Expect` refusal: aiohttp sends it without running the middlewares."""
    ex = owner.recorder.begin(request, route_of(request, prefixes), owner.clock())
    ex.request_id = response.headers[request_id.HEADER]
    ex.status = response.status
    ex.bytes_sent = bytes_of(response)
    owner.recorder.record(ex, 0.0)


class Recorder:
    def __init__(self, metrics: Metrics, slo: dict[tuple[str, str], tuple[float, float]]) -> None:
        self.metrics = metrics
        # (lane name, priority class) -> (ttft objective, tpot objective), seconds
        self.slo = slo
        self.trusted: tuple[Network, ...] = ()  # [gateway] trusted_proxies
        # Each labelled series once: prometheus_client's labels() checks and locks per call.
        self._series: dict[tuple[object, ...], Any] = {}

    def apply(self, config: Config) -> None:
        """A (reloaded) configuration: the proxies trusted to name the client
        (`gateway.trusted_proxies`); the objectives are fixed at start."""
        self.trusted = networks(config.gateway.trusted_proxies)

    def _series_of(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*labels)
        return series

    def begin(self, request: web.Request, route: str, started: float) -> Exchange:
        """Open the request's Exchange and leave it on the request for the handler."""
        peer = request.remote or ""
        client = peer
        if self.trusted:  # the peer may be a load balancer naming the client
            headers = request.headers
            # Every line of each: a balancer may add its own X-Forwarded-For line beside
            # the client's rather than append to it.
            forwarded = ", ".join(headers.getall("Forwarded", ())) or None
            xff = ", ".join(headers.getall("X-Forwarded-For", ())) or None
            client = client_of(peer, self.trusted, forwarded, xff)
        ex = Exchange(
            route,
            request_id.current(),
            started,
            method=request.method,
            path=request.path[:_PATH_CHARS],
            client=client,
            peer=peer,
            protocol=f"HTTP/{request.version.major}.{request.version.minor}",
            bytes_received=request.content_length or 0,
            user_agent=request.headers.get("User-Agent", "")[:_USER_AGENT_CHARS],
        )
        request[EXCHANGE] = ex
        return ex

    def _account_slo(self, ex: Exchange, lane: str) -> None:
        """Count a finished stream against its lane's and class's TTFT and TPOT objectives."""
        assert ex.ttft is not None
        assert ex.tpot is not None
        priority = ex.priority
        ttft_goal, tpot_goal = self.slo[lane, priority]
        ttft_ok, tpot_ok = ex.ttft <= ttft_goal, ex.tpot <= tpot_goal
        slo, server = self.metrics.slo, ex.instance
        self._series_of(slo, lane, server, "ttft", "met" if ttft_ok else "missed", priority).inc()
        self._series_of(slo, lane, server, "tpot", "met" if tpot_ok else "missed", priority).inc()
        if ttft_ok and tpot_ok:
            self._series_of(self.metrics.goodput, lane, server, priority).inc()

    def _account_key(self, ex: Exchange) -> None:
        """Count a request against its key: its outcome, and the tokens it used."""
        model = ex.model or NONE
        metrics = self.metrics
        self._series_of(metrics.key_requests, ex.key, model, key_outcome(ex)).inc()
        prompt, completion = tokens_used(ex)
        if prompt:
            self._series_of(metrics.key_tokens, ex.key, model, "prompt").inc(prompt)
        if completion:
            self._series_of(metrics.key_tokens, ex.key, model, "completion").inc(completion)

    def record(self, ex: Exchange, duration: float) -> None:
        lane = ex.lane or NONE
        metrics = self.metrics
        if ex.key and ex.method == "POST":  # the proxied routes (the others are GETs)
            self._account_key(ex)
        metrics.request_series(
            ex.route,
            str(ex.status),
            lane,
            ex.model or NONE,
            ex.tag or NONE,
            reached=bool(ex.instance),
            now=ex.started + duration,
        ).inc()
        if ex.instance:  # TTFT and TPOT only of requests an instance answered
            self._series_of(metrics.duration, lane).observe(duration)
            if ex.ttft is not None:
                self._series_of(metrics.ttft, lane, ex.instance).observe(ex.ttft)
                if ex.tpot is not None:
                    self._series_of(metrics.tpot, lane, ex.instance).observe(ex.tpot)
                    self._account_slo(ex, lane)
        quiet = ex.route in PROBE_ROUTES and 200 <= ex.status < 300
        method = "debug" if quiet else "info"
        fields = dict(
            client=ex.client or None,
            peer=ex.peer if ex.peer and ex.peer != ex.client else None,
            method=ex.method or None,
            path=ex.path or None,
            route=ex.route,
            key=ex.key or None,
            priority=None if ex.priority == "interactive" else ex.priority,
            model=ex.model or None,
            requested_model=ex.requested_model or None,
            status=ex.status,
            prompt_tokens=ex.prompt_tokens if ex.lane else None,
            completion_tokens=ex.tokens,
            protocol=ex.protocol or None,
            bytes_received=ex.bytes_received,
            bytes_sent=ex.bytes_sent,
            cut=ex.cut,
            refused=ex.refused or None,
            server=ex.instance or None,
            prefill_server=ex.prefill_instance or None,
            hop=ex.hop_path or None,
            attempts=ex.attempts,
            migrated=len(ex.migrated_to) or None,
            migrated_to=ex.migrated_to or None,
            queue_wait_ms=round(ex.queue_wait * 1000, 2) if ex.lane else None,
            ttft_ms=None if ex.ttft is None else round(ex.ttft * 1000, 2),
            duration_ms=round(duration * 1000, 2),
            user_agent=ex.user_agent or None,
            request_id=ex.request_id or None,
            tag=ex.tag or None,
            lane=ex.lane or None,
        )
        # One call through our JSON chain; through structlog when another chain is set.
        if not log.line(method, "request", fields):
            getattr(_access, method)("request", **fields)
