"""`gateway --workers 2` and signals: SIGHUP reaches every worker, a second SIGTERM ends
the drain as it does for one process.

One scenario runs once for the module, set up as _worker_helpers.py describes: a stream
keeps one worker busy while the parent gets SIGHUP, then SIGTERM twice.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _worker_helpers import (
    DRAIN,
    Stream,
    complete,
    named,
    new_session,
    read_log,
    stream_chat,
    two_workers,
    wait_for_events,
)
from fakes import log_events
from faultproxy import eventually


@dataclass
class Signals:
    after_hup: str  # the log between SIGHUP and the first SIGTERM
    status_after_hup: int
    worker_pids: set[str]
    stopped_after: float | None  # seconds from the second SIGTERM to the parent's exit
    exit_code: int | None
    stream: Stream
    log: str


async def _signals(folder: Path) -> Signals:
    async with two_workers(folder) as (proc, log):
        text = await wait_for_events(log, proc, "listening", 2)
        url = str(named(text, "supervising")[0]["url"])
        pids = {str(e["worker_pid"]) for e in named(text, "listening")}
        async with new_session() as session:
            stream = Stream()
            # Still streaming at the second SIGTERM, however slow the machine: 3,000
            # tokens take 90 s (a loaded machine once took 30 s to get there).
            task = asyncio.create_task(stream_chat(session, url, stream, tokens=3000))
            await eventually(lambda: stream.first_token, timeout=20)
            before = len(await read_log(log))
            proc.send_signal(signal.SIGHUP)

            async def handled_by_all() -> bool:
                events = log_events((await read_log(log))[before:])
                return {str(e["worker_pid"]) for e in events if "worker_pid" in e} >= pids

            async with asyncio.timeout(15):  # each worker reloads on its own: a loaded
                while not await handled_by_all():  # machine may take a while
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # and nothing else happens meanwhile
            after_hup = (await read_log(log))[before:]
            status, _ = await complete(session, url)
            proc.send_signal(signal.SIGTERM)  # the stream keeps one worker draining
            await wait_for_events(log, proc, "draining", 2)
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
        return Signals(
            after_hup, status, pids, stopped_after, exit_code, stream, await read_log(log)
        )


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
    assert not named(signals.log, "worker_died")


def test_a_second_sigterm_ends_the_drain_as_one_process_does(signals: Signals) -> None:
    """A second SIGTERM is forwarded: the stream ends in-band, it is logged, all exit 0."""
    assert signals.exit_code == 0, signals.log[-3000:]
    assert signals.stopped_after is not None
    assert signals.stopped_after < 8
    assert [e["exit_code"] for e in named(signals.log, "worker_exited")] == [0, 0]
    assert named(signals.log, "workers_forced")[0]["reason"] == "second stop signal"
    assert not named(signals.log, "workers_killed")
    data = [ln for ln in signals.stream.lines if ln.startswith("data:")]
    assert data[-1] == "data: [DONE]", signals.stream
    assert any(ln.startswith('data: {"error"') for ln in data), data[-3:]
    streamed = [e for e in named(signals.log, "request") if e.get("route") == "chat.completions"]
    assert len(streamed) >= 2  # the stream and the request after SIGHUP, each logged
