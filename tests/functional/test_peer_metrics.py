"""A worker's merged /metrics under `--workers` (peer_metrics.py), against loopback peers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.peer_metrics import PORTS_ENV, SCRAPE_TIMEOUT, SLOT_ENV, PeerMetrics
from gateway.process.workers import reserve_port


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
def slots() -> Iterator[list[int]]:
    """Four slots' private ports, reserved as the supervisor reserves them."""
    reserved = [reserve_port("127.0.0.1", 0) for _ in range(4)]
    try:
        yield [int(sock.getsockname()[1]) for sock in reserved]
    finally:
        for sock in reserved:
            sock.close()


@pytest.fixture
async def workers(slots: list[int]) -> AsyncIterator[tuple[PeerMetrics, PeerMetrics]]:
    one = PeerMetrics(_registry(3), slots[:2], 0)
    two = PeerMetrics(_registry(4), slots[:2], 1)
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
    workers: tuple[PeerMetrics, PeerMetrics],
) -> None:
    """A slot nobody listens on (its worker restarting), and one that never answers, are
    left out in time."""

    release = asyncio.Event()

    async def stuck(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response()

    hanging = await _server(stuck)
    try:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            workers[0].ports += [hanging.addresses[0][1], closed.getsockname()[1]]
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
    workers: tuple[PeerMetrics, PeerMetrics],
) -> None:
    """A peer answering something that is not Prometheus text does not make /metrics fail."""

    async def garbage(request: web.Request) -> web.StreamResponse:
        return web.Response(text="this is { not metrics\n")

    bad = await _server(garbage)
    try:
        workers[0].ports.append(bad.addresses[0][1])
        values = _values(await workers[0].exposition())
    finally:
        await bad.cleanup()
    assert values["gateway_requests_total[]"] == 3  # its own only
    assert values["gateway_workers_scraped[('result', 'answered')]"] == 1
    assert values["gateway_workers_scraped[('result', 'skipped')]"] == 2


async def test_a_restarted_worker_listens_on_its_slots_port_again(slots: list[int]) -> None:
    """The slot's reserved port is free for the next worker of that slot, and only for it."""
    for _ in range(2):
        worker = PeerMetrics(_registry(1), slots, 2)
        await worker.start()
        assert worker.port == slots[2]
        assert worker.peer_ports() == [slots[0], slots[1], slots[3]]
        await worker.close()


def test_a_worker_finds_its_slot_in_its_environment() -> None:
    """What the supervisor sets names every slot's port and this worker's; nothing else: None."""
    environ = {PORTS_ENV: "8101,8102,8103", SLOT_ENV: "1"}
    worker = PeerMetrics.from_environment(CollectorRegistry(), environ)
    assert worker is not None
    assert (worker.port, worker.peer_ports()) == (8102, [8101, 8103])
    assert PeerMetrics.from_environment(CollectorRegistry(), {}) is None
