"""Test harness: simulated vLLM instances and a gateway, all on 127.0.0.1, port 0.

`gateway_with(sims, ...)` writes a real config.toml/settings.json into a temp folder,
loads it through the config contract, and serves the app in-process the way the CLI
does (handler cancellation on, our own access log). Everything it starts it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.config import load as gateway_config
from gateway.fleet.discovery import Resolver, system_resolver
from gateway.server.app import build_app
from gateway.server.resources import DISPATCHER, LIFECYCLE, METRICS, PROBER
from gateway.server.runner import make_runner
from gateway.sim.sim_vllm import SimConfig, SimInstance

KEY = "sk-test-unified-key"


@dataclass
class Gateway:
    url: str
    app: web.Application
    sims: Sequence[SimInstance]
    config: gateway_config.Config

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def dispatcher(self) -> Any:
        return self.app[DISPATCHER]

    @property
    def prober(self) -> Any:
        return self.app[PROBER]

    @property
    def metrics(self) -> Any:
        return self.app[METRICS]

    @property
    def lifecycle(self) -> Any:
        return self.app[LIFECYCLE]

    def names(self) -> list[str]:
        return [s.name for s in self.dispatcher.scheduler.instances.states]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def write_config(
    folder: Path,
    instance_urls: Sequence[str | dict[str, Any]],
    *,
    sections: dict[str, dict[str, Any]] | None = None,
    channel: dict[str, Any] | None = None,
) -> Path:
    merged: dict[str, dict[str, Any]] = {
        "gateway": {"host": "127.0.0.1", "port": 0, "api_key_env": "UNUSED_TEST_KEY_ENV"},
        "dispatch": {"strategy": "least_busy", "health_check_interval": 0.2},
        "prefill": {},
    }
    for name, values in (sections or {}).items():
        merged.setdefault(name, {}).update(values)
    lines = []
    for name, values in merged.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
        for sub, subvalues in ((k, v) for k, v in values.items() if isinstance(v, dict)):
            lines.append(f"[{name}.{sub}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in subvalues.items()]
    (folder / "config.toml").write_text("\n".join(lines) + "\n")
    settings = {
        "channel": {
            "api_key": KEY,
            "default_model": "sim-model",
            "timeout": {"connect": 2, "read": 10, "write": 5},
            "retry": {"max_attempts": 3, "backoff_base": 0.01, "backoff_max": 0.05},
            **(channel or {}),
        },
        "vllm": {"instances": list(instance_urls)},
    }
    (folder / "settings.json").write_text(json.dumps(settings))
    return folder / "config.toml"


@contextlib.asynccontextmanager
async def gateway_with(
    sims: Sequence[SimInstance],
    *,
    instances: Sequence[dict[str, Any]] | None = None,
    sections: dict[str, dict[str, Any]] | None = None,
    channel: dict[str, Any] | None = None,
    send_buffer: int | None = None,
    resolver: Resolver = system_resolver,
) -> AsyncIterator[Gateway]:
    """`send_buffer` fixes SO_SNDBUF of client connections (Linux's autotuning off), so a
    test of a client that stops reading does not depend on how much the kernel buffers.
    `resolver` answers for `"discover": "dns"` entries."""
    urls: Sequence[str | dict[str, Any]] = instances or [s.url for s in sims]
    with tempfile.TemporaryDirectory() as folder:
        path = write_config(Path(folder), urls, sections=sections, channel=channel)
        config = gateway_config.load(path)
    app = build_app(config, resolver=resolver)
    runner = make_runner(app, shutdown_timeout=2)
    await runner.setup()
    try:
        host, port = await runner.listen("127.0.0.1", 0)
        if send_buffer is not None:  # accepted connections inherit the listener's size
            for listener in runner.sockets:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        yield Gateway(f"http://{host}:{port}", app, sims, config)
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """A test's own little server (a collector, an instance's /tokenize): `app` on a free
    loopback port, for as long as the block runs; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def fleet(*configs: SimConfig) -> AsyncIterator[list[SimInstance]]:
    sims = [SimInstance(c) for c in configs]
    try:
        for sim in sims:
            await sim.start()
        yield sims
    finally:
        for sim in sims:
            await sim.stop()


def log_events(text: str) -> list[dict[str, Any]]:
    """The JSON log lines in a process's output, other lines skipped."""
    events = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                events.append(event)
    return events


async def until_available(gw: Gateway, tries: int = 100) -> None:
    """Wait until /admin/instances says every instance is available (probed up)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as s:
        for _ in range(tries):
            body = await (await s.get(gw.url + "/admin/instances", headers=auth)).json()
            if all(i["available"] for i in body["instances"]):
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the fleet did not come up")
