"""`[gateway] reload_on_change` in a served gateway: an edit of the files, or a Kubernetes
ConfigMap's swap of its `..data` link, reloads them as SIGHUP does (the new setting takes
effect, the reload is counted); a bad file is refused and the running configuration stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from fakes import KEY, fleet, write_config

from gateway.config import load as gateway_config
from gateway.process import watch
from gateway.server.app import build_app
from gateway.server.resources import METRICS, PROXY
from gateway.server.runner import make_runner
from gateway.sim.sim_vllm import SimConfig

LOOK = 0.05  # seconds between the watcher's looks: a change settles within 0.1 s
WATCHED = {"reload_on_change": True}
NEW_KEY = "sk-test-rotated-key-0123"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.asynccontextmanager
async def watched_gateway(config_path: Path) -> AsyncIterator[tuple[str, Any]]:
    """The gateway of `config_path`, served with the file watch as serve.py adds it."""
    app = build_app(gateway_config.load(config_path))
    app.cleanup_ctx.append(watch.reloading(LOOK))
    runner = make_runner(app, shutdown_timeout=2)
    await runner.setup()
    try:
        host, port = await runner.listen("127.0.0.1", 0)
        yield f"http://{host}:{port}", app
    finally:
        await runner.cleanup()


def reloads(app: Any, result: str) -> float:
    value = app[METRICS].registry.get_sample_value(
        "gateway_config_reloads_total", {"result": result}
    )
    return float(value or 0)


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.02)


async def _status(url: str, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status


def sections(**gateway: Any) -> dict[str, dict[str, Any]]:
    return {"gateway": {**WATCHED, **gateway}}


async def test_an_edited_file_is_reloaded(tmp_path: Path) -> None:
    """Editing config.toml in place changes what runs: /readyz reports the new readiness,
    and gateway_config_reloads_total{result="applied"} moves."""
    async with fleet(SimConfig(instant=True)) as sims:
        urls = [s.url for s in sims]
        async with watched_gateway(write_config(tmp_path, urls, sections=sections())) as (
            url,
            app,
        ):
            await asyncio.sleep(3 * LOOK)  # the watch has taken the files as they are
            assert reloads(app, "applied") == 0
            write_config(tmp_path, urls, sections=sections(readiness="process"))
            await until(lambda: reloads(app, "applied") == 1)
            assert app[PROXY].config.gateway.readiness == "process"
            async with aiohttp.ClientSession() as session, session.get(url + "/readyz") as r:
                assert (await r.json())["readiness"] == "process"
            await asyncio.sleep(5 * LOOK)
            assert reloads(app, "applied") == 1  # once per change, not once per look


def _configmap_version(root: Path, version: str, urls: list[str], key: str) -> None:
    """A ConfigMap's files as the kubelet writes them: a new `..<version>` folder, then
    `..data` swapped to it in one rename; `config.toml` and `settings.json` are links
    through `..data`."""
    folder = root / f"..{version}"
    folder.mkdir()
    write_config(folder, urls, sections=sections(), channel={"api_key": key})
    (root / "..data.tmp").symlink_to(folder.name)
    os.replace(root / "..data.tmp", root / "..data")
    for name in ("config.toml", "settings.json"):
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")


async def test_a_configmap_swap_is_reloaded(tmp_path: Path) -> None:
    """A Kubernetes-style swap of `..data` to a folder with another key: the new key is
    served and the old refused, with no signal sent."""
    async with fleet(SimConfig(instant=True)) as sims:
        urls = [s.url for s in sims]
        _configmap_version(tmp_path, "2026_01_01_00_00_00.1", urls, KEY)
        async with watched_gateway(tmp_path / "config.toml") as (url, app):
            assert await _status(url, KEY) == 200
            await asyncio.sleep(3 * LOOK)
            _configmap_version(tmp_path, "2026_01_01_00_01_00.2", urls, NEW_KEY)
            await until(lambda: reloads(app, "applied") == 1)
            assert await _status(url, NEW_KEY) == 200
            assert await _status(url, KEY) == 401


async def test_a_bad_file_keeps_the_running_configuration(tmp_path: Path) -> None:
    """A config.toml that does not parse is refused once (counted as failed, the gauge at
    0); the gateway serves on with what ran; fixing the file reloads it."""
    async with fleet(SimConfig(instant=True)) as sims:
        urls = [s.url for s in sims]
        config_path = write_config(tmp_path, urls, sections=sections())
        async with watched_gateway(config_path) as (url, app):
            await asyncio.sleep(3 * LOOK)
            running = app[PROXY].config
            config_path.write_text("[gateway\nreadiness = 'process'\n")
            await until(lambda: reloads(app, "failed") == 1)
            await asyncio.sleep(5 * LOOK)
            assert reloads(app, "failed") == 1  # not retried while the file stays bad
            assert app[PROXY].config is running
            gauge = app[METRICS].registry.get_sample_value("gateway_config_last_reload_successful")
            assert gauge == 0
            assert await _status(url, KEY) == 200
            write_config(tmp_path, urls, sections=sections(readiness="process"))
            await until(lambda: reloads(app, "applied") == 1)
            assert app[PROXY].config.gateway.readiness == "process"


async def test_without_the_setting_nothing_is_watched(tmp_path: Path) -> None:
    """`reload_on_change` off (the default): an edited file changes nothing until SIGHUP."""
    async with fleet(SimConfig(instant=True)) as sims:
        urls = [s.url for s in sims]
        async with watched_gateway(write_config(tmp_path, urls)) as (_, app):
            await asyncio.sleep(3 * LOOK)
            write_config(tmp_path, urls, sections={"gateway": {"readiness": "process"}})
            await asyncio.sleep(6 * LOOK)
            assert reloads(app, "applied") == reloads(app, "failed") == 0
            assert app[PROXY].config.gateway.readiness == "fleet"
