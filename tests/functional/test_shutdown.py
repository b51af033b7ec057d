"""Graceful shutdown of the real process: `python -m gateway`, 50 streams, then SIGTERM.

One scenario runs once for the module (a subprocess start and a drain cost seconds): two
simulated instances in this process, each taking 20 of the gateway's requests; 20 short
streams that can finish within `drain_timeout`, 20 long ones that cannot, and 10 more
waiting in the gateway queue. Once all 40 have streamed their first token and 10 wait,
the gateway gets SIGTERM. For `drain_delay` it still serves and accepts connections while
/readyz answers 503; then the listener closes and the drain proper starts. The tests then
read what every client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai
import pytest
from fakes import KEY, write_config
from faultproxy import eventually

from gateway.sim.sim_vllm import SimConfig, SimInstance

DRAIN = 3.0
DELAY = 0.5  # drain_delay: shorter than what the short streams have left
PER_INSTANCE = 20
SHORT_TOKENS = 60  # about 2 s at 30 ms a token: still running when the listener closes
LONG_TOKENS = 1000  # about 40 s: still running at the drain deadline
QUEUED = 10
SIM = SimConfig(decode_s_per_token=0.03, prefill_tokens_per_s=1e6, max_num_seqs=64)
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """What one client saw."""

    kind: str  # short | long | queued
    status: int = 0
    retry_after: str | None = None
    first_token_at: float | None = None
    lines: list[str] = field(default_factory=list)
    ended_at: float | None = None
    error: str | None = None  # an exception the client raised, if any

    @property
    def done(self) -> bool:
        data = [ln for ln in self.lines if ln.startswith("data:")]
        return self.error is None and bool(data) and data[-1] == "data: [DONE]"

    @property
    def in_band_error(self) -> bool:
        data = [ln for ln in self.lines if ln.startswith("data:")]
        return self.done and len(data) >= 2 and data[-2].startswith('data: {"error"')


@dataclass
class Drain:
    outcomes: list[Outcome]
    sigterm_at: float
    refused_after: float | None  # seconds from SIGTERM until a new connection was refused
    readyz_after_sigterm: list[int]  # statuses /readyz answered after SIGTERM
    served_after_sigterm: int  # status of GET /v1/models sent just after SIGTERM
    exit_code: int | None
    exited_after: float | None
    log: str


async def _read(log: Path) -> str:
    return await asyncio.to_thread(log.read_text, errors="replace")


async def _listening_url(log: Path, proc: asyncio.subprocess.Process) -> str:
    """The URL from the gateway's `listening` log line (it binds port 0)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = await _read(log)
        if proc.returncode is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}: {text[-2000:]}")
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "listening":
                    return str(event["url"])
        await asyncio.sleep(0.05)
    raise RuntimeError(f"gateway did not listen within 30 s: {(await _read(log))[-2000:]}")


async def _stream(client: openai.AsyncOpenAI, out: Outcome, max_tokens: int) -> None:
    try:
        async with client.chat.completions.with_streaming_response.create(
            model="sim-model",
            messages=[{"role": "user", "content": "drain me"}],
            stream=True,
            max_tokens=max_tokens,
        ) as resp:
            out.status = resp.status_code
            async for line in resp.iter_lines():
                if out.first_token_at is None and line.startswith("data:"):
                    out.first_token_at = time.monotonic()
                out.lines.append(line)
    except openai.APIStatusError as exc:
        out.status = exc.status_code
        out.retry_after = exc.response.headers.get("Retry-After")
    except Exception as exc:  # the point is to record how a stream ended, whatever it was
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended_at = time.monotonic()


async def _probe_after_sigterm(url: str, statuses: list[int]) -> float | None:
    """Ask /readyz until the listener refuses; return when that happened (from now)."""
    started = time.monotonic()
    host, port = url.removeprefix("http://").split(":")
    while time.monotonic() - started < DELAY + DRAIN + 5:
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return time.monotonic() - started
        writer.close()
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with (
                aiohttp.ClientSession() as s,
                s.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=1)) as resp,
            ):
                statuses.append(resp.status)
        await asyncio.sleep(0.02)
    return None


async def _scenario(folder: Path) -> Drain:
    sims = [SimInstance(SIM), SimInstance(SIM)]
    for sim in sims:
        await sim.start()
    log = folder / "gateway.log"
    try:
        config = write_config(
            folder,
            [{"url": s.url, "max_num_seqs": PER_INSTANCE} for s in sims],
            sections={
                "gateway": {"drain_timeout": DRAIN, "drain_delay": DELAY, "request_timeout": 60},
                "dispatch": {"max_queue_per_instance": 0, "health_check_interval": 60},
            },
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--config", str(config),
                cwd=ROOT, env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        try:
            return await _drive(proc, await _listening_url(log, proc), log)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        for sim in sims:
            await sim.stop()


async def _drive(proc: asyncio.subprocess.Process, url: str, log: Path) -> Drain:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    async with client:
        outcomes = [Outcome("long") for _ in range(PER_INSTANCE)]
        outcomes += [Outcome("short") for _ in range(PER_INSTANCE)]
        tasks = [
            asyncio.create_task(
                _stream(client, out, LONG_TOKENS if out.kind == "long" else SHORT_TOKENS)
            )
            for out in outcomes
        ]
        started = outcomes[:]
        await eventually(lambda: all(o.first_token_at for o in started), timeout=20)
        queued = [Outcome("queued") for _ in range(QUEUED)]
        outcomes += queued
        tasks += [asyncio.create_task(_stream(client, out, SHORT_TOKENS)) for out in queued]
        await _wait_queued(url, QUEUED)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        statuses: list[int] = []
        probing = asyncio.create_task(_probe_after_sigterm(url, statuses))
        await asyncio.sleep(0.2)
        served = await client.models.with_raw_response.list()
        refused_after = await probing
        try:
            async with asyncio.timeout(DELAY + DRAIN + 10):
                await asyncio.gather(*tasks)
                exit_code = await proc.wait()
            exited_after: float | None = time.monotonic() - sigterm_at
        except TimeoutError:
            exit_code, exited_after = None, None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return Drain(
        outcomes,
        sigterm_at,
        refused_after,
        statuses,
        served.status_code,
        exit_code,
        exited_after,
        await _read(log),
    )


async def _wait_queued(url: str, count: int) -> None:
    deadline = time.monotonic() + 10
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            async with s.get(url + "/metrics") as resp:
                text = await resp.text()
            depth = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("gateway_queue_depth{")
            )
            if depth >= count:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{count} requests never queued in the gateway")


@pytest.fixture(scope="module")
def drain(tmp_path_factory: pytest.TempPathFactory) -> Drain:
    return asyncio.run(_scenario(tmp_path_factory.mktemp("shutdown")))


def _of(drain: Drain, kind: str) -> list[Outcome]:
    return [o for o in drain.outcomes if o.kind == kind]


def test_process_exits_0_soon_after_the_drain_deadline(drain: Drain) -> None:
    """After SIGTERM the process exits 0, soon after drain_delay + drain_timeout."""
    assert drain.exit_code == 0, drain.log[-3000:]
    assert drain.exited_after is not None
    assert drain.exited_after < DELAY + DRAIN + 3


def test_readiness_says_503_for_drain_delay_while_serving_then_the_listener_closes(
    drain: Drain,
) -> None:
    """For drain_delay after SIGTERM, new connections are taken, /readyz answers 503 and
    requests are served; then new connections are refused."""
    assert drain.refused_after is not None
    assert DELAY - 0.1 < drain.refused_after < DELAY + 1.0
    assert drain.readyz_after_sigterm
    assert set(drain.readyz_after_sigterm) == {503}
    assert drain.served_after_sigterm == 200


def test_queued_requests_get_503_with_retry_after(drain: Drain) -> None:
    """Requests still waiting in the gateway queue at SIGTERM get 503 with Retry-After."""
    queued = _of(drain, "queued")
    assert [o.status for o in queued] == [503] * QUEUED, [o.error for o in queued]
    assert all(o.retry_after and int(o.retry_after) >= 1 for o in queued)
    assert all(o.ended_at is not None and o.ended_at - drain.sigterm_at < DELAY + 1 for o in queued)


def test_started_streams_that_can_finish_end_with_done(drain: Drain) -> None:
    """Streams that finish within drain_timeout run to `data: [DONE]` without an error."""
    short = _of(drain, "short")
    assert all(o.done and not o.in_band_error for o in short), [
        (o.error, o.lines[-2:]) for o in short if not o.done
    ]


def test_streams_still_running_at_the_deadline_end_with_an_in_band_error(drain: Drain) -> None:
    """Streams still running at drain_timeout end with an in-band error event and `[DONE]`."""
    long = _of(drain, "long")
    assert all(o.in_band_error for o in long), [(o.error, o.lines[-2:]) for o in long][:3]
    assert all(
        o.ended_at is not None
        and DELAY + DRAIN - 0.5 < o.ended_at - drain.sigterm_at < DELAY + DRAIN + 2
        for o in long
    )


def test_no_client_is_cut_silently(drain: Drain) -> None:
    """Every client got a whole stream, an in-band error, or an HTTP error status: none was cut."""
    cut = [o for o in drain.outcomes if o.error is not None or (o.status == 200 and not o.done)]
    assert not cut, [(o.kind, o.error) for o in cut][:5]


def test_bad_config_exits_2_without_binding_its_port(tmp_path: Path) -> None:
    """A process started on an invalid config exits 2 naming the field, and never binds its port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = write_config(
        tmp_path,
        ["http://127.0.0.1:9"],
        sections={"gateway": {"port": port}, "dispatch": {"max_queue_per_instance": -1}},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "dispatch.max_queue_per_instance" in proc.stderr
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# ------------------------------------------------------------ a second signal


@dataclass
class Forced:
    stream: Outcome
    readyz_before: int | None  # /readyz after the first SIGTERM (None: the listener closed)
    exit_code: int | None
    exited_after: float | None  # seconds from the second SIGTERM
    log: str


async def _forced_scenario(folder: Path, delay: float) -> Forced:
    sim = SimInstance(SIM)
    await sim.start()
    log = folder / "gateway.log"
    try:
        config = write_config(
            folder,
            [sim.url],
            sections={
                "gateway": {"drain_timeout": 60, "drain_delay": delay},
                "dispatch": {"health_check_interval": 60},
            },
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--config", str(config),
                cwd=ROOT, env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        try:
            url = await _listening_url(log, proc)
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            async with client:
                out = Outcome("long")
                task = asyncio.create_task(_stream(client, out, LONG_TOKENS))
                await eventually(lambda: out.first_token_at is not None, timeout=20)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                readyz: int | None = None
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    async with aiohttp.ClientSession() as s, s.get(url + "/readyz") as resp:
                        readyz = resp.status
                second = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                async with asyncio.timeout(10):
                    exit_code = await proc.wait()
                    exited_after: float | None = time.monotonic() - second
                    await task
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        await sim.stop()
    return Forced(out, readyz, exit_code, exited_after, await _read(log))


def test_a_second_sigterm_ends_the_drain_at_once(tmp_path: Path) -> None:
    """A second SIGTERM during a long drain_delay exits 0 at once; the stream ends in-band."""
    forced = asyncio.run(_forced_scenario(tmp_path, delay=60))
    assert forced.readyz_before == 503
    assert forced.exit_code == 0, forced.log[-2000:]
    assert forced.exited_after is not None
    assert forced.exited_after < 3.0
    assert forced.stream.in_band_error, forced.stream.lines[-3:]
    assert '"drain_forced"' in forced.log


def test_a_second_sigterm_during_the_drain_timeout_forces_the_exit(tmp_path: Path) -> None:
    """A second SIGTERM once the listener closed and streams have 60 s left exits 0 at once,
    the running stream ended in-band rather than cut."""
    forced = asyncio.run(_forced_scenario(tmp_path, delay=0))
    assert forced.readyz_before is None  # no drain_delay: the listener closed at once
    assert forced.exit_code == 0, forced.log[-2000:]
    assert forced.exited_after is not None
    assert forced.exited_after < 3.0
    assert forced.stream.in_band_error, forced.stream.lines[-3:]
    assert '"drain_forced"' in forced.log
