"""The application's middlewares, outermost first, and the order they must keep:

    request id (request_id.py)   every answer carries X-Request-ID, errors included
    recording (recorder.py)      one access line and the metrics of every answer
    errors (here)                aiohttp's 404/405/413 and our errors in the route's shape
    trace (here)                 a proxied request's trace starts, so a 401 is a span too
    key (auth.py)                checked before any handler reads the request (its tag)

Each is made by a factory from what it needs, so none reaches into the app for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway import errors
from gateway.observe import trace_context
from gateway.observe.recorder import EXCHANGE
from gateway.routes import summary

if TYPE_CHECKING:
    from gateway.observe.exchange import Exchange
    from gateway.observe.tracing import Spans

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def shaped_errors(apis: Mapping[str, errors.Api]) -> Middleware:
    """The middleware that gives aiohttp's own errors (404, 405, 413) and ours the shape of
    the path's API: `apis` names it by path (Anthropic's on the Messages routes); any other
    path, one no route serves included, gets OpenAI's."""

    @web.middleware
    async def shaped(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except errors.GatewayError as exc:
            error = exc
        except web.HTTPNotFound:
            error = errors.NotFound(f"no route {request.method} {request.path}: {summary()}")
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            error = errors.MethodNotAllowed(
                f"{request.method} is not allowed on {request.path}; use {allowed}"
            )
        except web.HTTPRequestEntityTooLarge:
            error = errors.PayloadTooLarge("the request body is larger than the gateway's limit")
        return error.response(api=apis.get(request.path, "openai"))

    return shaped


def traced(spans: Callable[[web.Request], Spans | None], routes: Iterable[str]) -> Middleware:
    """The trace of each request to one of `routes` (the proxied ones, by route name): the
    client's, continued, or a new one; its id is logged, and with OpenTelemetry on the
    request's span ends with the status the client got."""
    proxied = frozenset(routes)

    @web.middleware
    async def trace(request: web.Request, handler: Handler) -> web.StreamResponse:
        ex = request.get(EXCHANGE)
        if ex is None or ex.route not in proxied:
            return await handler(request)
        start_trace(spans(request), request, ex)
        try:
            return await handler(request)
        except errors.GatewayError as exc:  # the key's (the proxy answers its own)
            ex.status = exc.status
            raise
        finally:
            if ex.span is not None:
                ex.span.end(
                    ex.status,
                    lane=ex.lane,
                    model=ex.model,
                    instance=ex.instance,
                    attempts=ex.attempts,
                    request_id=ex.request_id,
                )

    return trace


def start_trace(spans: Spans | None, request: web.Request, ex: Exchange) -> None:
    client = trace_context.from_headers(request.headers)
    if spans is None:
        ex.trace = client or trace_context.fresh()
    else:
        ex.span = spans.request(request.path, request.method, client)
        ex.trace = trace_context.TraceContext(
            ex.span.trace_id,
            ex.span.span_id,
            ex.span.flags,
            client.state if client is not None else None,
            from_client=client is not None,
        )
    structlog.contextvars.bind_contextvars(trace_id=ex.trace.trace_id)


# What the admin listener serves (`[gateway] admin_port`); the main port serves the rest.
ADMIN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})
# Served on both: a load balancer that checks the pod's IP at the API port (a cloud LB's
# target group, a NodePort's health check) must find the probes there too.
BOTH_PATHS = frozenset({"/healthz", "/readyz"})


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith("/admin/")


def split_listeners(admin_port: Callable[[], int | None]) -> Middleware:
    """With an admin listener: operations routes only there, the API only on the main port,
    the probes on both; the other answers 404 as an unknown route does. `admin_port` is the
    bound port."""

    @web.middleware
    async def split(request: web.Request, handler: Handler) -> web.StreamResponse:
        transport = request.transport
        local = transport.get_extra_info("sockname") if transport is not None else None
        on_admin = isinstance(local, tuple) and local[1] == admin_port()
        if on_admin != is_admin_path(request.path) and request.path not in BOTH_PATHS:
            raise web.HTTPNotFound()
        return await handler(request)

    return split
