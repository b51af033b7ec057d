"""The routes a prober and a scraper read, which take no key: liveness (`/healthz`),
readiness (`/readyz`) and the Prometheus exposition (`/metrics`, every worker's with
`--workers`).
May import: `gateway.server.resources` and every package below `gateway.server`.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.server.resources import DISPATCHER, LIFECYCLE, METRICS, PEERS, PROXY

UNKEYED = ("/healthz", "/readyz", "/metrics")  # probes and scrapes take no key


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/healthz", _healthz)
    router.add_get("/readyz", _readyz)
    router.add_get("/metrics", _metrics)


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
