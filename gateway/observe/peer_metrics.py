"""A worker's side of `/metrics` under `gateway --workers N`: one scrape answers for all.

The kernel hands a scrape to any one worker. So each worker also serves its own registry
on a private loopback port: the supervisor reserves one port per worker slot (bound with
SO_REUSEPORT, never listening, so nobody else takes it while a worker restarts) and tells
each worker every slot's port and its own (`GATEWAY_WORKER_PORTS`, `GATEWAY_WORKER_SLOT`,
set only in its workers). Nothing is written to disk, so a read-only root file system is
fine. The worker that answers the public `/metrics` fetches every other slot's private
exposition in parallel (its own it reads directly) and merges them (metrics_merge.py).
A worker that does not answer within `SCRAPE_TIMEOUT` (dead, being
restarted, stuck) is left out, and the answer says so:
`gateway_workers_scraped{result="answered"}` and `{result="skipped"}`.

A restarted worker's counters start again from zero, so the merged counters drop by what
the dead worker had counted: Prometheus's `rate()` and `increase()` read a drop as a
counter reset, as they do when a single process restarts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from gateway.config.schema import Timeouts
from gateway.observe import log
from gateway.observe.metrics_merge import merge, render
from gateway.upstream.client import Upstream
from gateway.upstream.response import AttemptFailed

PORTS_ENV = "GATEWAY_WORKER_PORTS"  # every slot's private metrics port, comma-separated
SLOT_ENV = "GATEWAY_WORKER_SLOT"  # this worker's slot: its port is PORTS_ENV's at that index
WORKER_HEADER = "X-Gateway-Worker"
SCRAPE_TIMEOUT = 1.0  # seconds; Prometheus's own scrape timeout is 10 s by default

_log = log.get("gateway.peer_metrics")


class PeerMetrics:
    """This worker's private metrics listener, and the merged scrape of every worker's."""

    def __init__(self, registry: CollectorRegistry, ports: Sequence[int], slot: int) -> None:
        self.registry = registry
        self.ports = list(ports)
        self.slot = slot
        self.port = self.ports[slot]
        self._runner: web.AppRunner | None = None
        self._upstream: Upstream | None = None

    @classmethod
    def from_environment(
        cls, registry: CollectorRegistry, environ: Mapping[str, str] = os.environ
    ) -> PeerMetrics | None:
        """This worker's, from what the supervisor set; None outside a worker."""
        ports = environ.get(PORTS_ENV)
        if not ports:
            return None
        return cls(registry, [int(p) for p in ports.split(",")], int(environ[SLOT_ENV]))

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._private)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # reuse_port: the supervisor holds the port reserved with SO_REUSEPORT.
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_port=True)
        await site.start()
        # Not pooled: a worker that died leaves no kept-alive connection behind.
        self._upstream = Upstream(100, Timeouts(connect=SCRAPE_TIMEOUT), pooled=False)
        await self._upstream.start()

    async def close(self) -> None:
        if self._upstream is not None:
            await self._upstream.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _private(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    def peer_ports(self) -> list[int]:
        """The other slots' private ports (a slot whose worker is restarting is skipped)."""
        return [port for slot, port in enumerate(self.ports) if slot != self.slot]

    async def _fetch(self, port: int) -> str | None:
        assert self._upstream is not None
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT):  # head and body together
                status, body = await self._upstream.fetch(
                    f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT
                )
        except (AttemptFailed, TimeoutError):
            return None
        return body.decode("utf-8", "replace") if status == 200 else None

    async def exposition(self) -> bytes:
        """Every worker's metrics merged, plus how many workers answered."""
        own = generate_latest(self.registry).decode()
        ports = self.peer_ports()
        texts = await asyncio.gather(*(self._fetch(port) for port in ports))
        answered = [text for text in texts if text is not None]
        skipped = len(texts) - len(answered)
        if skipped:
            _log.warning("worker_metrics_skipped", skipped=skipped, timeout_s=SCRAPE_TIMEOUT)
        try:
            families = merge([own, *answered])
        except ValueError:  # a worker of another version, a cut answer: answer with ours
            _log.warning("worker_metrics_unreadable", workers=len(answered))
            families, skipped, answered = merge([own]), skipped + len(answered), []
        scraped = GaugeMetricFamily(
            "gateway_workers_scraped",
            "Workers whose metrics this answer holds (answered, this one included) and "
            "those left out because they did not answer in time (skipped).",
            labels=["result"],
        )
        scraped.add_metric(["answered"], 1 + len(answered))
        scraped.add_metric(["skipped"], skipped)
        return render([*families, scraped])

    def __repr__(self) -> str:
        return f"<PeerMetrics slot={self.slot} port={self.port} peers={self.peer_ports()}>"
