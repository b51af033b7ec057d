"""What the `gateway --workers 2` tests share (test_workers.py, test_worker_signals.py).

`python -m gateway --workers 2` runs as a real process before two simulated instances in
this process, without `[shared]` unless a test adds it. Every request goes on a new
connection, so the kernel's SO_REUSEPORT spreads them over both workers; each answer names
its worker in `X-Gateway-Worker`. What the processes did is read back from the log's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from fakes import KEY, log_events, write_config

from gateway.sim.sim_vllm import SimConfig, SimInstance

ROOT = Path(__file__).resolve().parents[2]
HEADER = "X-Gateway-Worker"
SIM = SimConfig(decode_s_per_token=0.03, prefill_tokens_per_s=1e6, max_num_seqs=64)
STREAM_TOKENS = 100  # about 3 s at 30 ms a token: several scrapes fit while they run
DRAIN = 10.0  # long enough for every stream: a clean drain


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


class Logged(Protocol):
    """A scenario's record that kept the gateway's log."""

    log: str


def named(run_or_text: Logged | str, name: str) -> list[dict[str, Any]]:
    text = run_or_text if isinstance(run_or_text, str) else run_or_text.log
    return [e for e in log_events(text) if e.get("event") == name]


def new_session() -> aiohttp.ClientSession:
    # A new connection per request: the kernel picks a worker per connection.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=aiohttp.ClientTimeout(total=30),
    )


async def complete(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get(HEADER, "")


async def stream_chat(
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


async def read_log(log: Path) -> str:
    return await asyncio.to_thread(log.read_text, errors="replace")


async def wait_for_events(
    log: Path, proc: asyncio.subprocess.Process, name: str, count: int
) -> str:
    """The log once it holds `count` events named `name`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        exited = proc.returncode is not None  # before the read: its last lines are in it
        text = await read_log(log)
        if len(named(text, name)) >= count:
            return text
        if exited:
            raise RuntimeError(f"gateway exited {proc.returncode}: {text[-3000:]}")
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no {count} `{name}` events within 60 s: {(await read_log(log))[-3000:]}")


@contextlib.asynccontextmanager
async def two_workers(
    folder: Path,
    sections: dict[str, dict[str, Any]] | None = None,
    *,
    channel: dict[str, Any] | None = None,
    extra_env: dict[str, str] | None = None,
    entries: Callable[[list[str]], list[Any]] | None = None,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, Path]]:
    """`python -m gateway --workers 2` before two simulated instances; its log file.
    `entries`: the instance entries to configure, made from the instances' URLs."""
    sims = [SimInstance(SIM), SimInstance(SIM)]
    for sim in sims:
        await sim.start()
    log = folder / "gateway.log"
    try:
        urls = [s.url for s in sims]
        config = write_config(
            folder,
            entries(urls) if entries is not None else urls,
            sections={
                "gateway": {"drain_timeout": DRAIN, "request_timeout": 60},
                "dispatch": {"health_check_interval": 60},
                **(sections or {}),
            },
            channel=channel,
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env.update(extra_env or {})
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
