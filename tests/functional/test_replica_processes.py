"""Gateway replicas as real processes sharing one Redis: a crash, a restart, Redis away.

One scenario runs once for the module (process starts cost seconds): two simulated
instances in this process, a redis-server, and two `python -m gateway` replicas, A and B,
each on its own port with `[shared] redis_url` (rounds every 0.1 s, a TTL of 1 s). The
clients spread requests over the replicas themselves, as a round-robin front would.

1. kill: 4 streams on each replica; once B's `/admin/instances` shows A's 4, A gets
   SIGKILL; B's streams must end with [DONE]; we time how long A's load stays in B's view;
2. rejoin: A starts again on its port; B must count it as a peer again, and 3 streams on
   A must show in B's view and end with [DONE];
3. Redis away: redis-server gets SIGKILL while 3 streams run on each replica and requests
   keep coming to both; when it restarts on its port, both see each other again.
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
from redis_server import RedisServer, free_port, redis_server

from gateway.sim.sim_vllm import SimConfig, SimInstance

ROOT = Path(__file__).resolve().parents[2]
SIM = SimConfig(decode_s_per_token=0.02, prefill_tokens_per_s=1e6, max_num_seqs=64)
PUBLISH, TTL = 0.1, 1.0
STREAM_TOKENS = 100  # about 2 s at 20 ms a token: long enough to kill a replica mid-stream
HEADERS = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Stream:
    status: int = 0
    lines: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def done(self) -> bool:
        data = [ln for ln in self.lines if ln.startswith("data:")]
        return self.error is None and self.status == 200 and data[-1:] == ["data: [DONE]"]


@dataclass
class Run:
    # 1. kill
    peer_load_seen_before_kill: int  # A's streams in B's view (sum over instances)
    a_streams: list[Stream]
    b_streams: list[Stream]
    after_kill: list[int]  # statuses of requests to B right after the kill
    load_gone_after: float | None  # seconds from the kill until A's load left B's view
    peers_after_kill: float  # B's gateway_shared_state_peers once it did
    # 2. rejoin
    peers_after_restart: float
    rejoined_load_seen: int  # the restarted A's streams in B's view
    rejoined_streams: list[Stream]
    # 3. Redis away
    outage_streams: list[Stream]
    outage_requests: list[int]
    up_during_outage: list[float]  # gateway_shared_state_up of A and B while Redis is away
    after_redis_returns: list[tuple[float, float]]  # (up, peers) of A and B
    logs: str = ""


class Replica:
    """One `python -m gateway` on a fixed port, so that a restart comes back on it."""

    def __init__(self, folder: Path, config: Path, port: int) -> None:
        self.folder, self.config, self.port = folder, config, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with (self.folder / f"gateway-{self.starts}.log").open("wb") as sink:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--config", str(self.config),
                cwd=ROOT, env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"replica exited {self.proc.returncode}: {self.log()}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    body = await admin(http, self)
                    if all(i["available"] for i in body["instances"]):
                        return
                await asyncio.sleep(0.05)
        raise RuntimeError(f"replica on {self.port} not ready within 60 s: {self.log()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no drain, no goodbye to Redis

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    def log(self, tail: int = 3000) -> str:
        """Its logs, every start's, each cut to its last `tail` characters (0: whole)."""
        texts = (p.read_text(errors="replace") for p in sorted(self.folder.glob("*.log")))
        return "".join(text[-tail:] if tail else text for text in texts)


async def admin(http: aiohttp.ClientSession, replica: Replica) -> dict[str, Any]:
    async with http.get(replica.url + "/admin/instances") as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def peers_inflight(http: aiohttp.ClientSession, replica: Replica) -> int:
    """The other replicas' streams in `replica`'s view, summed over the instances."""
    return sum(int(i["peers_inflight"]) for i in (await admin(http, replica))["instances"])


async def shared_gauges(http: aiohttp.ClientSession, replica: Replica) -> tuple[float, float]:
    """(gateway_shared_state_up, gateway_shared_state_peers) from `replica`'s /metrics."""
    async with http.get(replica.url + "/metrics") as resp:
        text = await resp.text()
    values = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("gateway_shared_")
    )
    return (
        float(values.get("gateway_shared_state_up", "nan")),
        float(values.get("gateway_shared_state_peers", "nan")),
    )


async def stream(http: aiohttp.ClientSession, replica: Replica, out: Stream) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hold on"}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
    }
    try:
        async with http.post(replica.url + "/v1/chat/completions", json=body) as resp:
            out.status = resp.status
            async for raw in resp.content:
                if line := raw.decode().strip():
                    out.lines.append(line)
    except Exception as exc:  # the point is to record how a stream ended, whatever it was
        out.error = f"{type(exc).__name__}: {exc}"


async def complete(http: aiohttp.ClientSession, replica: Replica) -> int:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        async with http.post(replica.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status
    except aiohttp.ClientError:
        return 0


def streams_on(
    http: aiohttp.ClientSession, replica: Replica, count: int
) -> tuple[list[Stream], list[asyncio.Task[None]]]:
    streams = [Stream() for _ in range(count)]
    return streams, [asyncio.create_task(stream(http, replica, s)) for s in streams]


async def until(probe: Any, check: Any, timeout: float) -> Any:
    """Poll `await probe()` until `check(value)`; the last value (it may not satisfy check)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if check(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def replicas(
    folder: Path, redis: RedisServer
) -> AsyncIterator[tuple[Replica, Replica, list[SimInstance]]]:
    sims = [SimInstance(SIM), SimInstance(SIM)]
    for sim in sims:
        await sim.start()
    pair: list[Replica] = []
    try:
        for name in ("a", "b"):
            port = free_port()
            (folder / name).mkdir()
            config = write_config(
                folder / name,
                [s.url for s in sims],
                sections={
                    "gateway": {"port": port, "drain_timeout": 5, "request_timeout": 60},
                    "dispatch": {"health_check_interval": 0.5},
                    "shared": {"redis_url": redis.url, "publish_interval": PUBLISH, "ttl": TTL},
                },
            )
            pair.append(Replica(folder / name, config, port))
        for replica in pair:
            await replica.start()
        yield pair[0], pair[1], sims
    finally:
        for replica in pair:
            await replica.stop()
        for sim in sims:
            await sim.stop()


async def _scenario(folder: Path, redis: RedisServer) -> Run:
    async with (
        replicas(folder, redis) as (a, b, _),
        aiohttp.ClientSession(headers=HEADERS, timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        await until(lambda: shared_gauges(http, b), lambda v: v == (1.0, 1.0), 10)
        # 1. kill
        a_streams, a_tasks = streams_on(http, a, 4)
        b_streams, b_tasks = streams_on(http, b, 4)
        seen = await until(lambda: peers_inflight(http, b), lambda n: n == 4, 5)
        a.kill()
        killed_at = time.monotonic()
        after_kill = list(await asyncio.gather(*(complete(http, b) for _ in range(4))))
        left = await until(lambda: peers_inflight(http, b), lambda n: n == 0, 10)
        gone_after = time.monotonic() - killed_at if left == 0 else None
        _, peers_after_kill = await until(lambda: shared_gauges(http, b), lambda v: v[1] == 0, 5)
        await asyncio.gather(*a_tasks, *b_tasks)
        # 2. rejoin
        await a.start()
        _, peers_after_restart = await until(
            lambda: shared_gauges(http, b), lambda v: v[1] == 1, 10
        )
        rejoined, tasks = streams_on(http, a, 3)
        rejoined_seen = await until(lambda: peers_inflight(http, b), lambda n: n == 3, 5)
        await asyncio.gather(*tasks)
        # 3. Redis away
        outage_a, tasks_a = streams_on(http, a, 3)
        outage_b, tasks_b = streams_on(http, b, 3)
        await until(lambda: peers_inflight(http, b), lambda n: n == 3, 5)
        redis.stop()
        requests: list[int] = []
        for _ in range(5):  # requests keep coming to both while Redis is away
            requests += await asyncio.gather(complete(http, a), complete(http, b))
            await asyncio.sleep(0.1)
        up_during = [
            (await until(lambda r=r: shared_gauges(http, r), lambda v: v[0] == 0, 5))[0]
            for r in (a, b)
        ]
        requests += await asyncio.gather(complete(http, a), complete(http, b))
        await asyncio.gather(*tasks_a, *tasks_b)
        redis.start()
        after = [
            await until(lambda r=r: shared_gauges(http, r), lambda v: v == (1.0, 1.0), 15)
            for r in (a, b)
        ]
        return Run(
            peer_load_seen_before_kill=seen,
            a_streams=a_streams,
            b_streams=b_streams,
            after_kill=after_kill,
            load_gone_after=gone_after,
            peers_after_kill=peers_after_kill,
            peers_after_restart=peers_after_restart,
            rejoined_load_seen=rejoined_seen,
            rejoined_streams=rejoined,
            outage_streams=outage_a + outage_b,
            outage_requests=requests,
            up_during_outage=up_during,
            after_redis_returns=after,
            logs=a.log(0) + b.log(0),
        )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    with redis_server() as redis:
        return asyncio.run(_scenario(tmp_path_factory.mktemp("replicas"), redis))


def test_a_replica_killed_loses_only_its_own_streams(run: Run) -> None:
    """SIGKILL on A breaks A's streams; B's run to [DONE] and B answers new requests at once."""
    assert run.peer_load_seen_before_kill == 4  # B saw A's streams before the kill
    assert all(s.done for s in run.b_streams), [s.error or s.lines[-1:] for s in run.b_streams]
    assert not any(s.done for s in run.a_streams)
    assert run.after_kill == [200] * 4


def test_a_killed_replicas_load_leaves_the_others_view_within_the_ttl(run: Run) -> None:
    """A's 4 streams leave B's view once A's key expires: within the TTL and a round or two."""
    assert run.load_gone_after is not None, "A's load never left B's view"
    # The key was written at most a round before the kill and expires TTL later; B sees
    # it gone at its next round. Half a second more for a busy machine.
    assert run.load_gone_after <= TTL + 2 * PUBLISH + 0.5, run.load_gone_after
    assert run.peers_after_kill == 0


def test_a_restarted_replica_rejoins_the_view_and_serves(run: Run) -> None:
    """A started again on its port: B counts it as a peer, sees its streams, and they finish."""
    assert run.peers_after_restart == 1
    assert run.rejoined_load_seen == 3
    assert all(s.done for s in run.rejoined_streams)


def test_redis_killed_mid_run_fails_no_request_and_the_view_recovers(run: Run) -> None:
    """With Redis SIGKILLed both replicas say it is down and serve everything; back, they rejoin."""
    assert run.up_during_outage == [0.0, 0.0]
    assert all(s.done for s in run.outage_streams), [s.error for s in run.outage_streams]
    assert run.outage_requests == [200] * len(run.outage_requests)
    assert run.after_redis_returns == [(1.0, 1.0), (1.0, 1.0)]
    down = [e for e in log_events(run.logs) if e.get("event") == "shared_state_down"]
    assert len(down) == 2  # logged once per replica, not once per failed round
