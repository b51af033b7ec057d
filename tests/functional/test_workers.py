"""`gateway --workers 2`: the real process, two workers on one port, supervised.

One scenario runs once for the module (process starts cost seconds): two simulated
instances in this process, and `python -m gateway --workers 2` before them, without
`[shared]`. Every request goes on a new connection, so the kernel's SO_REUSEPORT spreads
them over both workers; each answer names its worker in `X-Gateway-Worker`.

1. spread: 20 requests, then scrapes of `/metrics` until both workers have answered one;
2. kill: one worker gets SIGKILL; once a new one listens, 20 more requests;
3. drain: 16 streams of about 3 s on both workers, a few scrapes while they run, then
   SIGTERM to the parent, which must forward it so each worker drains.

A second scenario sends SIGHUP, then SIGTERM twice; a third runs the workers with a real
Redis and checks that they see each other in the shared view.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import KEY, log_events, write_config
from faultproxy import eventually
from redis_server import redis_server

from gateway.sim.sim_vllm import SimConfig, SimInstance

ROOT = Path(__file__).resolve().parents[2]
HEADER = "X-Gateway-Worker"
SIM = SimConfig(decode_s_per_token=0.03, prefill_tokens_per_s=1e6, max_num_seqs=64)
REQUESTS = 20
STREAMS = 16
STREAM_TOKENS = 100  # about 3 s at 30 ms a token: several scrapes fit while they run
DRAIN = 10.0  # long enough for every stream: a clean drain


@dataclass
class Scrape:
    """One answer of the public /metrics."""

    worker: str
    requests: float  # sum of gateway_requests_total for the chat route
    up: dict[str, float]  # gateway_instance_up by instance
    inflight: float  # sum of gateway_instance_inflight
    answered: float  # gateway_workers_scraped{result="answered"}


@dataclass
class Stream:
    worker: str = ""
    status: int = 0
    lines: list[str] = field(default_factory=list)
    first_token: bool = False
    error: str | None = None

    @property
    def done(self) -> bool:
        data = [ln for ln in self.lines if ln.startswith("data:")]
        return (
            self.error is None
            and bool(data)
            and data[-1] == "data: [DONE]"
            and not any(ln.startswith('data: {"error"') for ln in data)
        )


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


def _named(run_or_text: Run | str, name: str) -> list[dict[str, Any]]:
    text = run_or_text.log if isinstance(run_or_text, Run) else run_or_text
    return [e for e in log_events(text) if e.get("event") == name]


def _session() -> aiohttp.ClientSession:
    # A new connection per request: the kernel picks a worker per connection.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=aiohttp.ClientTimeout(total=30),
    )


async def _complete(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get(HEADER, "")


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


async def _stream(
    session: aiohttp.ClientSession, url: str, out: Stream, tokens: int = STREAM_TOKENS
) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "drain me"}],
        "max_tokens": tokens,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            out.status, out.worker = resp.status, resp.headers.get(HEADER, "")
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    out.first_token = True
                if line:
                    out.lines.append(line)
    except Exception as exc:  # the point is to record how a stream ended, whatever it was
        out.error = f"{type(exc).__name__}: {exc}"


async def _read(log: Path) -> str:
    return await asyncio.to_thread(log.read_text, errors="replace")


async def _wait_for(log: Path, proc: asyncio.subprocess.Process, name: str, count: int) -> str:
    """The log once it holds `count` events named `name`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = await _read(log)
        if len(_named(text, name)) >= count:
            return text
        if proc.returncode is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}: {text[-3000:]}")
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no {count} `{name}` events within 60 s: {(await _read(log))[-3000:]}")


@contextlib.asynccontextmanager
async def _gateway(
    folder: Path, sections: dict[str, dict[str, Any]] | None = None
) -> AsyncIterator[tuple[asyncio.subprocess.Process, Path]]:
    """`python -m gateway --workers 2` before two simulated instances; its log file."""
    sims = [SimInstance(SIM), SimInstance(SIM)]
    for sim in sims:
        await sim.start()
    log = folder / "gateway.log"
    try:
        config = write_config(
            folder,
            [s.url for s in sims],
            sections={
                "gateway": {"drain_timeout": DRAIN, "request_timeout": 60},
                "dispatch": {"health_check_interval": 60},
                **(sections or {}),
            },
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--config", str(config), "--workers", "2",
                cwd=ROOT, env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        try:
            yield proc, log
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        for sim in sims:
            await sim.stop()


async def _scenario(folder: Path) -> Run:
    async with _gateway(folder) as (proc, log):
        return await _drive(proc, log)


async def _drive(proc: asyncio.subprocess.Process, log: Path) -> Run:
    text = await _wait_for(log, proc, "listening", 2)
    url = str(_named(text, "supervising")[0]["url"])
    started = [int(e["pid"]) for e in _named(text, "worker_started")]
    async with _session() as session:
        # 1. spread
        spread = [await _complete(session, url) for _ in range(REQUESTS)]
        scrapes: list[Scrape] = []
        for _ in range(40):
            scrapes.append(await _scrape(session, url))
            if len({s.worker for s in scrapes}) == 2:
                break
        # 2. kill
        killed = int(spread[0][1])
        os.kill(killed, signal.SIGKILL)
        await _wait_for(log, proc, "listening", 3)
        after_kill = [await _complete(session, url) for _ in range(REQUESTS)]
        # 3. drain
        streams = [Stream() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(_stream(session, url, s)) for s in streams]
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
        log=await _read(log),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_scenario(tmp_path_factory.mktemp("workers")))


def test_both_workers_serve(run: Run) -> None:
    """Requests on many connections are answered by two different worker processes."""
    assert set(run.spread) == {str(pid) for pid in run.started_pids[:2]}, run.log[-3000:]


def test_each_log_line_of_a_worker_names_it(run: Run) -> None:
    """A request's log line carries `worker_pid`, the pid its X-Gateway-Worker header gave."""
    logged = {str(e.get("worker_pid")) for e in _named(run, "request")}
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
    died = _named(run, "worker_died")
    assert [(e["pid"], e["exit_code"]) for e in died] == [(run.killed, -signal.SIGKILL)]
    pids = [e["pid"] for e in _named(run, "worker_started")]
    assert len(pids) == 3
    assert pids[2] not in pids[:2]


def test_requests_keep_succeeding_after_a_kill(run: Run) -> None:
    """After the restart every request succeeds, on the survivor and the new worker only."""
    assert [status for status, _ in run.after_kill] == [200] * REQUESTS
    workers = {worker for _, worker in run.after_kill}
    assert str(run.killed) not in workers
    pids = [e["pid"] for e in _named(run, "worker_started")]
    assert workers == {str(pid) for pid in pids if pid != run.killed}


def test_sigterm_drains_every_worker_and_exits_0(run: Run) -> None:
    """SIGTERM reaches both workers: each drains, every stream ends with [DONE], exit 0."""
    assert run.exit_code == 0, run.log[-3000:]
    assert all(s.status == 200 and s.done for s in run.streams), [
        (s.error, s.lines[-2:]) for s in run.streams if not s.done
    ]
    assert len(_named(run, "drained")) == 2
    exited = _named(run, "worker_exited")
    assert sorted(e["exit_code"] for e in exited) == [0, 0]
    assert _named(run, "stopped")[-1]["clean"] is True


def test_workers_without_redis_warn_at_start(run: Run) -> None:
    """Without `[shared] redis_url` the supervisor warns that each worker has its own view."""
    warned = _named(run, "workers_without_shared_state")
    assert len(warned) == 1
    assert warned[0]["level"] == "warning"


# ------------------------------------------------- SIGHUP, then two SIGTERMs


@dataclass
class Signals:
    after_hup: str  # the log between SIGHUP and the first SIGTERM
    status_after_hup: int
    worker_pids: set[str]
    stopped_after: float | None  # seconds from the second SIGTERM to the parent's exit
    exit_code: int | None
    log: str


async def _signals(folder: Path) -> Signals:
    async with _gateway(folder) as (proc, log):
        text = await _wait_for(log, proc, "listening", 2)
        url = str(_named(text, "supervising")[0]["url"])
        pids = {str(e["worker_pid"]) for e in _named(text, "listening")}
        async with _session() as session:
            stream = Stream()
            # Still streaming at the second SIGTERM: about 30 s.
            task = asyncio.create_task(_stream(session, url, stream, tokens=1000))
            await eventually(lambda: stream.first_token, timeout=20)
            before = len(await _read(log))
            proc.send_signal(signal.SIGHUP)

            async def handled_by_all() -> bool:
                events = log_events((await _read(log))[before:])
                return {str(e["worker_pid"]) for e in events if "worker_pid" in e} >= pids

            async with asyncio.timeout(15):  # each worker reloads on its own: a loaded
                while not await handled_by_all():  # machine may take a while
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # and nothing else happens meanwhile
            after_hup = (await _read(log))[before:]
            status, _ = await _complete(session, url)
            proc.send_signal(signal.SIGTERM)  # the stream keeps one worker draining
            await _wait_for(log, proc, "draining", 2)
            second = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(DRAIN):
                    exit_code: int | None = await proc.wait()
                stopped_after: float | None = time.monotonic() - second
            except TimeoutError:
                exit_code = stopped_after = None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return Signals(after_hup, status, pids, stopped_after, exit_code, await _read(log))


@pytest.fixture(scope="module")
def signals(tmp_path_factory: pytest.TempPathFactory) -> Signals:
    return asyncio.run(_signals(tmp_path_factory.mktemp("worker-signals")))


def test_sighup_reaches_every_worker_and_kills_none(signals: Signals) -> None:
    """SIGHUP is forwarded: each worker logs its handling of it, none dies, requests go on."""
    events = log_events(signals.after_hup)
    assert [e["event"] for e in events if "worker_pid" not in e] == ["sighup_forwarded"]
    handled = {str(e["worker_pid"]) for e in events if "worker_pid" in e}
    assert handled == signals.worker_pids
    assert signals.status_after_hup == 200
    assert not _named(signals.log, "worker_died")


def test_a_second_sigterm_kills_the_workers_at_once(signals: Signals) -> None:
    """A second SIGTERM during the drain sends SIGKILL: the parent exits 1 within seconds."""
    assert signals.exit_code == 1, signals.log[-3000:]
    assert signals.stopped_after is not None
    assert signals.stopped_after < 5
    exited = _named(signals.log, "worker_exited")
    assert -signal.SIGKILL in [e["exit_code"] for e in exited]
    assert _named(signals.log, "workers_killed")[0]["reason"] == "second stop signal"


# ------------------------------------------------------------- with Redis


def test_workers_share_their_view_through_redis(tmp_path: Path) -> None:
    """With `[shared] redis_url` each worker sees the other in Redis, and no warning is logged."""

    async def scenario(redis_url: str) -> tuple[list[tuple[str, float, float]], str]:
        shared = {"shared": {"redis_url": redis_url, "publish_interval": 0.05, "ttl": 0.5}}
        async with _gateway(tmp_path, shared) as (proc, log):
            text = await _wait_for(log, proc, "listening", 2)
            url = str(_named(text, "supervising")[0]["url"])
            async with _session() as session:
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
            return scrapes, await _read(log)

    with redis_server() as redis:
        scrapes, log = asyncio.run(scenario(redis.url))
    assert scrapes[-1][1:] == (1.0, 1.0), scrapes[-5:]
    assert not _named(log, "workers_without_shared_state")
