"""A worker's merged /metrics under `--workers` (peer_metrics.py), against loopback peers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.peer_metrics import SCRAPE_TIMEOUT, PeerMetrics


def _registry(requests: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("gateway_requests", "Requests.", registry=registry).inc(requests)
    return registry


def _values(text: bytes) -> dict[str, float]:
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


async def _server(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[tuple[PeerMetrics, PeerMetrics]]:
    one = PeerMetrics(_registry(3), tmp_path, pid=101)
    two = PeerMetrics(_registry(4), tmp_path, pid=102)
    await one.start()
    await two.start()
    try:
        yield one, two
    finally:
        await one.close()
        await two.close()


async def test_one_worker_answers_for_all(workers: tuple[PeerMetrics, PeerMetrics]) -> None:
    """Either worker's answer counts both workers' requests and says two answered."""
    for worker in workers:
        values = _values(await worker.exposition())
        assert values["gateway_requests_total[]"] == 7
        assert values["gateway_workers_scraped[('result', 'answered')]"] == 2
        assert values["gateway_workers_scraped[('result', 'skipped')]"] == 0


async def test_dead_and_stuck_workers_are_skipped_and_counted(
    workers: tuple[PeerMetrics, PeerMetrics], tmp_path: Path
) -> None:
    """A published port nobody listens on, and one that never answers, are left out in time."""

    release = asyncio.Event()

    async def stuck(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response()

    hanging = await _server(stuck)
    try:
        (tmp_path / "103.port").write_text(str(hanging.addresses[0][1]))
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            (tmp_path / "104.port").write_text(str(closed.getsockname()[1]))
        started = asyncio.get_running_loop().time()
        values = _values(await workers[0].exposition())
        took = asyncio.get_running_loop().time() - started
    finally:
        release.set()
        await hanging.cleanup()
    assert values["gateway_requests_total[]"] == 7
    assert values["gateway_workers_scraped[('result', 'answered')]"] == 2
    assert values["gateway_workers_scraped[('result', 'skipped')]"] == 2
    assert took < SCRAPE_TIMEOUT + 2


async def test_an_unreadable_peer_leaves_the_answer_to_this_worker(
    workers: tuple[PeerMetrics, PeerMetrics], tmp_path: Path
) -> None:
    """A peer answering something that is not Prometheus text does not make /metrics fail."""

    async def garbage(request: web.Request) -> web.StreamResponse:
        return web.Response(text="this is { not metrics\n")

    bad = await _server(garbage)
    try:
        (tmp_path / "105.port").write_text(str(bad.addresses[0][1]))
        values = _values(await workers[0].exposition())
    finally:
        await bad.cleanup()
    assert values["gateway_requests_total[]"] == 3  # its own only
    assert values["gateway_workers_scraped[('result', 'answered')]"] == 1
    assert values["gateway_workers_scraped[('result', 'skipped')]"] == 2


async def test_a_closed_worker_withdraws_its_port(tmp_path: Path) -> None:
    """A worker that closes removes its published port, so no one waits for it."""
    worker = PeerMetrics(_registry(1), tmp_path, pid=106)
    await worker.start()
    assert (tmp_path / "106.port").read_text() == str(worker.port)
    await worker.close()
    assert not await asyncio.to_thread(lambda: list(tmp_path.glob("*.port")))
