"""`gateway --workers 2`: the real process, two workers on one port, supervised.

One scenario runs once for the module (process starts cost seconds), set up as
_worker_helpers.py describes:

1. spread: 20 requests, then scrapes of `/metrics` until both workers have answered one;
2. kill: one worker gets SIGKILL; once a new one listens, 20 more requests;
3. drain: 16 streams of about 3 s on both workers, a few scrapes while they run, then
   SIGTERM to the parent, which must forward it so each worker drains.

A second test runs the workers with a real Redis and checks that they see each other in the
shared view. SIGHUP and a second SIGTERM are in test_worker_signals.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _worker_helpers import (
    DRAIN,
    HEADER,
    Stream,
    complete,
    named,
    new_session,
    read_log,
    stream_chat,
    two_workers,
    wait_for_events,
)
from faultproxy import eventually
from redis_server import redis_server

from gateway.process.workers import PING_TIMEOUT

REQUESTS = 20
STREAMS = 16


@dataclass
class Scrape:
    """One answer of the public /metrics."""

    worker: str
    requests: float  # sum of gateway_requests_total for the chat route
    up: dict[str, float]  # gateway_instance_up by instance
    inflight: float  # sum of gateway_instance_inflight
    answered: float  # gateway_workers_scraped{result="answered"}


@dataclass
class Run:
    started_pids: list[int]  # from worker_started, before the kill
    spread: list[str]  # worker of each request of phase 1
    scrapes: list[Scrape]  # phase 1
    killed: int
    after_kill: list[tuple[int, str]]  # status, worker of each request of phase 2
    streams: list[Stream]
    scrapes_during_streams: list[Scrape]
    exit_code: int | None
    log: str
    events: list[dict[str, Any]] = field(default_factory=list)


async def _scrape(session: aiohttp.ClientSession, url: str) -> Scrape:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
        worker = resp.headers.get(HEADER, "")
    requests = inflight = answered = 0.0
    up: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        series, value = line.rsplit(" ", 1)
        if series.startswith("gateway_requests_total{") and 'route="chat.completions"' in series:
            requests += float(value)  # the scrapes themselves are counted too, on their route
        elif series.startswith("gateway_instance_inflight{"):
            inflight += float(value)
        elif series.startswith("gateway_instance_up{"):
            up[series] = float(value)
        elif series == 'gateway_workers_scraped{result="answered"}':
            answered = float(value)
    return Scrape(worker, requests, up, inflight, answered)


async def _scenario(folder: Path) -> Run:
    async with two_workers(folder) as (proc, log):
        return await _drive(proc, log)


async def _drive(proc: asyncio.subprocess.Process, log: Path) -> Run:
    text = await wait_for_events(log, proc, "listening", 2)
    url = str(named(text, "supervising")[0]["url"])
    started = [int(e["pid"]) for e in named(text, "worker_started")]
    async with new_session() as session:
        # 1. spread
        spread = [await complete(session, url) for _ in range(REQUESTS)]
        scrapes: list[Scrape] = []
        for _ in range(40):
            scrapes.append(await _scrape(session, url))
            if len({s.worker for s in scrapes}) == 2:
                break
        # 2. kill
        killed = int(spread[0][1])
        os.kill(killed, signal.SIGKILL)
        await wait_for_events(log, proc, "listening", 3)
        after_kill = [await complete(session, url) for _ in range(REQUESTS)]
        # 3. drain
        streams = [Stream() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(stream_chat(session, url, s)) for s in streams]
        await eventually(lambda: all(s.first_token for s in streams), timeout=20)
        during = [await _scrape(session, url) for _ in range(6)]
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(DRAIN + 15):
                await asyncio.gather(*tasks)
                exit_code: int | None = await proc.wait()
        except TimeoutError:
            exit_code = None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return Run(
        started_pids=started,
        spread=[worker for _, worker in spread],
        scrapes=scrapes,
        killed=killed,
        after_kill=after_kill,
        streams=streams,
        scrapes_during_streams=during,
        exit_code=exit_code,
        log=await read_log(log),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_scenario(tmp_path_factory.mktemp("workers")))


def test_both_workers_serve(run: Run) -> None:
    """Requests on many connections are answered by two different worker processes."""
    assert set(run.spread) == {str(pid) for pid in run.started_pids[:2]}, run.log[-3000:]


def test_each_log_line_of_a_worker_names_it(run: Run) -> None:
    """A request's log line carries `worker_pid`, the pid its X-Gateway-Worker header gave."""
    logged = {str(e.get("worker_pid")) for e in named(run, "request")}
    assert set(run.spread) <= logged


def test_one_scrape_counts_every_workers_requests(run: Run) -> None:
    """Whichever worker answers /metrics, it counts all 20 requests, and an up flag stays 1."""
    assert {s.worker for s in run.scrapes} == set(run.spread)
    for scrape in run.scrapes:
        assert scrape.requests == REQUESTS, scrape
        assert scrape.answered == 2, scrape
        assert sorted(scrape.up.values()) == [1.0, 1.0], scrape


def test_inflight_gauges_add_up_across_workers(run: Run) -> None:
    """While 16 streams run on both workers, every scrape shows 16 in flight, not one worker's."""
    assert len({s.worker for s in run.streams}) == 2, [s.worker for s in run.streams]
    assert [s.inflight for s in run.scrapes_during_streams] == [STREAMS] * 6


def test_a_killed_worker_is_restarted(run: Run) -> None:
    """A worker killed with SIGKILL is logged with its signal and replaced by a new pid."""
    died = named(run, "worker_died")
    assert [(e["pid"], e["exit_code"]) for e in died] == [(run.killed, -signal.SIGKILL)]
    pids = [e["pid"] for e in named(run, "worker_started")]
    assert len(pids) == 3
    assert pids[2] not in pids[:2]


def test_requests_keep_succeeding_after_a_kill(run: Run) -> None:
    """After the restart every request succeeds, on the survivor and the new worker only."""
    assert [status for status, _ in run.after_kill] == [200] * REQUESTS
    workers = {worker for _, worker in run.after_kill}
    assert str(run.killed) not in workers
    pids = [e["pid"] for e in named(run, "worker_started")]
    assert workers == {str(pid) for pid in pids if pid != run.killed}


def test_sigterm_drains_every_worker_and_exits_0(run: Run) -> None:
    """SIGTERM reaches both workers: each drains, every stream ends with [DONE], exit 0."""
    assert run.exit_code == 0, run.log[-3000:]
    assert all(s.status == 200 and s.done for s in run.streams), [
        (s.error, s.lines[-2:]) for s in run.streams if not s.done
    ]
    assert len(named(run, "drained")) == 2
    exited = named(run, "worker_exited")
    assert sorted(e["exit_code"] for e in exited) == [0, 0]
    assert named(run, "stopped")[-1]["clean"] is True


def test_workers_without_redis_warn_at_start(run: Run) -> None:
    """Without `[shared] redis_url` the supervisor warns that each worker has its own view."""
    warned = named(run, "workers_without_shared_state")
    assert len(warned) == 1
    assert warned[0]["level"] == "warning"


# ------------------------------------------------------------- with Redis


def test_workers_share_their_view_through_redis(tmp_path: Path) -> None:
    """With `[shared] redis_url` each worker sees the other in Redis, and no warning is logged."""

    async def scenario(redis_url: str) -> tuple[list[tuple[str, float, float]], str]:
        shared = {"shared": {"redis_url": redis_url, "publish_interval": 0.05, "ttl": 0.5}}
        async with two_workers(tmp_path, shared) as (proc, log):
            text = await wait_for_events(log, proc, "listening", 2)
            url = str(named(text, "supervising")[0]["url"])
            async with new_session() as session:
                scrapes: list[tuple[str, float, float]] = []
                for _ in range(100):
                    async with session.get(url + "/metrics") as resp:
                        body = await resp.text()
                        worker = resp.headers.get(HEADER, "")
                    values = dict(
                        line.rsplit(" ", 1)
                        for line in body.splitlines()
                        if line.startswith("gateway_shared_state_")
                    )
                    peers = float(values.get("gateway_shared_state_peers", "nan"))
                    up = float(values.get("gateway_shared_state_up", "nan"))
                    scrapes.append((worker, peers, up))
                    if peers == 1 and up == 1:
                        break
                    await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
            return scrapes, await read_log(log)

    with redis_server() as redis:
        scrapes, log = asyncio.run(scenario(redis.url))
    assert scrapes[-1][1:] == (1.0, 1.0), scrapes[-5:]
    assert not named(log, "workers_without_shared_state")


# ------------------------------------------------------------- a stuck worker


async def test_a_worker_that_stops_answering_is_replaced(tmp_path: Path) -> None:
    """A worker whose loop stops turning (here SIGSTOP) answers no ping: after the ping
    timeout the parent logs it, kills it and starts another; requests succeed again."""
    async with two_workers(tmp_path) as (proc, log):
        text = await wait_for_events(log, proc, "listening", 2)
        url = str(named(text, "supervising")[0]["url"])
        stuck = int(named(text, "worker_started")[0]["pid"])
        os.kill(stuck, signal.SIGSTOP)
        text = await wait_for_events(log, proc, "listening", 3)
        async with new_session() as session:
            after = [await complete(session, url) for _ in range(10)]
    unresponsive = named(text, "worker_unresponsive")
    assert [e["pid"] for e in unresponsive] == [stuck]
    assert unresponsive[0]["waited_s"] >= PING_TIMEOUT
    died = named(text, "worker_died")
    assert [(e["pid"], e["exit_code"]) for e in died] == [(stuck, -signal.SIGKILL)]
    assert [status for status, _ in after] == [200] * 10
    assert str(stuck) not in {worker for _, worker in after}
