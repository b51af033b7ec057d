"""`reload_on_change` in the real processes: `python -m gateway` reloads on a change of its
files; under `--workers 2` the supervisor watches them and takes SIGHUP's path on a change
(one read, every worker handed the result), and the workers never watch on their own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
from _worker_helpers import (
    DRAIN,
    ROOT,
    SIM,
    complete,
    named,
    read_log,
    two_workers,
    wait_for_events,
)
from fakes import KEY, write_config

from gateway.sim.sim_vllm import SimInstance

REVOKED = "sk-revoked-key-0123456789"


async def _statuses(url: str, key: str, count: int) -> list[int]:
    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(force_close=True)  # a worker picked per connection
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        return [(await complete(session, url))[0] for _ in range(count)]


async def test_the_supervisor_reloads_every_worker_on_a_file_change(tmp_path: Path) -> None:
    """Revoking a key in settings.json, with no signal: the supervisor sees the change once,
    forwards it, both workers reload, and neither serves the key any more."""
    gateway = {"drain_timeout": DRAIN, "request_timeout": 60, "reload_on_change": True}
    async with two_workers(tmp_path, {"gateway": gateway}, channel={"api_key": [KEY, REVOKED]}) as (
        proc,
        log,
    ):
        text = await wait_for_events(log, proc, "listening", 2)
        url = str(named(text, "supervising")[0]["url"])
        assert set(await _statuses(url, REVOKED, 4)) == {200}
        settings = json.loads((tmp_path / "settings.json").read_text())
        settings["channel"]["api_key"] = KEY
        (tmp_path / "settings.json").write_text(json.dumps(settings))
        text = await wait_for_events(log, proc, "reloaded", 2)
        assert [e["files"] for e in named(text, "config_changed")] == [
            [str(tmp_path / "settings.json")]
        ]
        assert len(named(text, "sighup_forwarded")) == 1
        assert {e["worker_pid"] for e in named(text, "reloaded")} == {
            e["worker_pid"] for e in named(text, "listening")
        }
        assert set(await _statuses(url, REVOKED, 8)) == {401}
        assert set(await _statuses(url, KEY, 4)) == {200}
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            metrics = await resp.text()
        # Each worker counted it; the merged scrape says one reload of the process (max).
        assert 'gateway_config_reloads_total{result="applied"} 1.0' in metrics
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
        changes = named(await read_log(log), "config_changed")
        assert len(changes) == 1
        assert "worker_pid" not in changes[0]  # the supervisor's


async def test_one_process_reloads_on_a_file_change(tmp_path: Path) -> None:
    """`python -m gateway` with reload_on_change: revoking a key in settings.json, with no
    signal, is logged as a change of that file, reloaded, and the key refused."""
    sim = SimInstance(SIM)
    await sim.start()
    log = tmp_path / "gateway.log"
    try:
        gateway = {"reload_on_change": True}
        channel = {"api_key": [KEY, REVOKED]}
        config = write_config(tmp_path, [sim.url], sections={"gateway": gateway}, channel=channel)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--config", str(config),
                cwd=ROOT, env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        try:
            text = await wait_for_events(log, proc, "listening", 1)
            url = str(named(text, "listening")[0]["url"])
            assert await _statuses(url, REVOKED, 1) == [200]
            settings = json.loads((tmp_path / "settings.json").read_text())
            settings["channel"]["api_key"] = KEY
            (tmp_path / "settings.json").write_text(json.dumps(settings))
            text = await wait_for_events(log, proc, "reloaded", 1)
            assert named(text, "config_changed")[0]["files"] == [str(tmp_path / "settings.json")]
            assert await _statuses(url, REVOKED, 1) == [401]
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        await sim.stop()
