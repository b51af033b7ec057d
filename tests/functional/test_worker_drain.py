"""`gateway --workers 2`: a drain reaches every worker, whichever one took the order, and a
worker started later (after a SIGKILL) starts with it; a resume likewise. Discovered
instances are the same in every worker."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
from _worker_helpers import HEADER, named, new_session, read_log, two_workers, wait_for_events


async def _views(session: aiohttp.ClientSession, url: str, count: int) -> list[tuple[str, Any]]:
    """`count` reads of /admin/instances, each on a new connection: (worker, drained names)."""
    views = []
    for _ in range(count):
        async with session.get(url + "/admin/instances") as resp:
            body = await resp.json()
            drained = sorted(i["name"] for i in body["instances"] if i["drained"])
            views.append((resp.headers[HEADER], drained))
    return views


async def _until_every_worker_says(
    session: aiohttp.ClientSession, url: str, drained: list[str]
) -> set[str]:
    """The workers seen, once 12 reads in a row from both say `drained` (within 5 s)."""
    async with asyncio.timeout(5):
        while True:
            views = await _views(session, url, 12)
            workers = {w for w, _ in views}
            if len(workers) == 2 and all(d == drained for _, d in views):
                return workers
            await asyncio.sleep(0.1)


async def test_a_drain_reaches_every_worker_and_outlives_a_worker_restart(tmp_path: Path) -> None:
    async with two_workers(tmp_path) as (proc, log), new_session() as session:
        text = await wait_for_events(log, proc, "listening", 2)
        url = str(named(text, "supervising")[0]["url"])
        assert [d for _, d in await _views(session, url, 4)] == [[]] * 4  # none drained yet
        async with session.get(url + "/admin/instances") as resp:
            name = (await resp.json())["instances"][0]["name"]
        async with session.post(f"{url}/admin/instances/{name}/drain") as resp:
            assert resp.status == 200
            took = resp.headers[HEADER]
        workers = await _until_every_worker_says(session, url, [name])
        assert took in workers

        # A worker restarted later starts with the supervisor's drains.
        os.kill(int(took), signal.SIGKILL)
        await wait_for_events(log, proc, "listening", 3)
        after = await _until_every_worker_says(session, url, [name])
        assert took not in after

        async with session.post(f"{url}/admin/instances/{name}/resume") as resp:
            assert resp.status == 200
        await _until_every_worker_says(session, url, [])
        forwarded = named(await read_log(log), "drains_forwarded")
        assert [e["drained"] for e in forwarded] == [[name], []]
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0


async def test_every_worker_discovers_the_same_instances(tmp_path: Path) -> None:
    """Each worker resolves on its own (the system's resolver: localhost, /etc/hosts): both
    list the same instances, named by address, and serve through them."""

    def by_dns(urls: list[str]) -> list[Any]:
        return [{"url": u.replace("127.0.0.1", "localhost"), "discover": "dns"} for u in urls]

    async with two_workers(tmp_path, entries=by_dns) as (proc, log), new_session() as session:
        text = await wait_for_events(log, proc, "listening", 2)
        url = str(named(text, "supervising")[0]["url"])
        seen: dict[str, set[str]] = {}
        async with asyncio.timeout(10):
            while len(seen) < 2:
                async with session.get(url + "/admin/instances") as resp:
                    body = await resp.json()
                    names = {i["name"] for i in body["instances"]}
                    seen.setdefault(resp.headers[HEADER], names)
        first, second = seen.values()
        assert first == second
        assert {n.split(":")[0] for n in first} >= {"127.0.0.1"}
        assert len(named(await read_log(log), "instances_discovered")) >= 2  # one per worker
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0
