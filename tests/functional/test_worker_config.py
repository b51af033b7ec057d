"""`gateway --workers 2` serves one configuration: the supervisor's, across reloads and restarts.

A worker restarted after a reload starts from what the running workers serve, never from the
files as they were at start; and nothing is written to disk, so a read-only root works.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
from pathlib import Path

import aiohttp
from _worker_helpers import complete, named, read_log, two_workers, wait_for_events
from fakes import KEY

REVOKED = "sk-revoked-key-0123456789"

# Python's audit hooks see every file the process opens for writing and every folder it
# makes; refusing them all (as a read-only root would, /dev aside) in the supervisor and
# in each spawned worker (sitecustomize runs in every interpreter) emulates
# `readOnlyRootFilesystem: true` without a container.
READ_ONLY = textwrap.dedent(
    """
    import os, sys

    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def _refuse(event, args):
        if event == "open":
            path, _, flags = args  # an int path is a descriptor already open (a pipe)
            writes = isinstance(flags, int) and flags & _WRITE
            if writes and isinstance(path, str) and not path.startswith("/dev/"):
                raise PermissionError(30, "Read-only file system", str(path))
        elif event in ("os.mkdir", "tempfile.mkdtemp", "tempfile.mkstemp", "os.rename"):
            raise PermissionError(30, "Read-only file system")

    sys.addaudithook(_refuse)
    """
)


async def _statuses(url: str, key: str, count: int) -> list[int]:
    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(force_close=True)  # a worker picked per connection
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        return [(await complete(session, url))[0] for _ in range(count)]


async def test_a_revoked_key_stays_revoked_after_a_worker_restarts(tmp_path: Path) -> None:
    """Revoke a key, SIGHUP, SIGKILL a worker: its replacement refuses the key too."""
    channel = {"api_key": [KEY, REVOKED]}
    async with two_workers(tmp_path, channel=channel) as (proc, log):
        text = await wait_for_events(log, proc, "listening", 2)
        url = str(named(text, "supervising")[0]["url"])
        assert set(await _statuses(url, REVOKED, 6)) == {200}
        settings = json.loads((tmp_path / "settings.json").read_text())
        settings["channel"]["api_key"] = KEY
        (tmp_path / "settings.json").write_text(json.dumps(settings))
        proc.send_signal(signal.SIGHUP)
        await wait_for_events(log, proc, "reloaded", 2)
        digests = {e["digest"] for e in named(await read_log(log), "sighup_forwarded")}
        victim = int(named(text, "listening")[0]["worker_pid"])
        os.kill(victim, signal.SIGKILL)
        await wait_for_events(log, proc, "listening", 3)  # the replacement serves
        assert set(await _statuses(url, REVOKED, 12)) == {401}
        assert set(await _statuses(url, KEY, 4)) == {200}
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            metrics = await resp.text()
        served = {
            line.split('"')[1]
            for line in metrics.splitlines()
            if line.startswith("gateway_config_info{")
        }
        assert served == digests, metrics  # one configuration, the reloaded one, everywhere


async def test_workers_run_under_a_read_only_root(tmp_path: Path) -> None:
    """No file or folder is written: two workers serve, and one scrape answers for both."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(READ_ONLY)
    env = {"PYTHONPATH": str(hooks), "PYTHONDONTWRITEBYTECODE": "1"}
    async with two_workers(tmp_path, extra_env=env) as (proc, log):
        text = await wait_for_events(log, proc, "listening", 2)
        url = str(named(text, "supervising")[0]["url"])
        assert set(await _statuses(url, KEY, 4)) == {200}
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            metrics = await resp.text()
        assert 'gateway_workers_scraped{result="answered"} 2.0' in metrics
        assert "Read-only file system" not in await read_log(log)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
