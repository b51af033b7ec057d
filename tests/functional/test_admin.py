"""What an operator reads: `[gateway] admin_port` (operations routes on their own listener,
the API on the main one), `trusted_proxies` (the client behind a load balancer, in the
access line) and `GET /admin/config` (what runs, and what waits for a restart)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from fakes import KEY, fleet, write_config

from gateway.config import load as gateway_config
from gateway.process.reload import reload
from gateway.server.app import build_app
from gateway.server.resources import DISPATCHER
from gateway.server.runner import make_runner
from gateway.sim.sim_vllm import SimConfig, SimInstance

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.asynccontextmanager
async def two_listeners(
    sims: list[SimInstance], gateway: dict[str, Any], folder: Path | None = None
) -> AsyncIterator[tuple[str, str, web.Application]]:
    """A gateway on a main and an admin port: both base URLs, and the app."""
    with tempfile.TemporaryDirectory() as scratch:
        where = folder or Path(scratch)
        path = write_config(where, [s.url for s in sims], sections={"gateway": gateway})
        config = gateway_config.load(path)
    app = build_app(config)
    runner = make_runner(app, shutdown_timeout=2)
    await runner.setup()
    try:
        host, port = await runner.listen("127.0.0.1", 0)
        admin_host, admin_port = await runner.listen_admin("127.0.0.1", 0)
        yield f"http://{host}:{port}", f"http://{admin_host}:{admin_port}", app
    finally:
        await runner.cleanup()


async def _status(session: aiohttp.ClientSession, method: str, url: str) -> int:
    body = CHAT if method == "POST" else None
    async with session.request(method, url, json=body, headers=AUTH) as resp:
        await resp.read()
        return resp.status


async def test_each_listener_serves_only_its_own_routes() -> None:
    """The API on the main port; metrics and admin on the admin port; the probes on both
    (for balancers that check the pod's IP at the API port); else 404."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, {"admin_port": 0}) as (api, admin, _),
        aiohttp.ClientSession() as session,
    ):
        assert await _status(session, "POST", api + "/v1/chat/completions") == 200
        assert await _status(session, "GET", api + "/v1/models") == 200
        for path in ("/metrics", "/admin/instances"):
            assert await _status(session, "GET", api + path) == 404, path
            assert await _status(session, "GET", admin + path) == 200, path
        for path in ("/healthz", "/readyz"):
            assert await _status(session, "GET", api + path) == 200, path
            assert await _status(session, "GET", admin + path) == 200, path
        assert await _status(session, "POST", admin + "/v1/chat/completions") == 404
        async with session.get(api + "/metrics") as resp:
            assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_the_client_behind_a_trusted_proxy_is_logged_with_its_peer() -> None:
    """With loopback trusted, X-Forwarded-For names the client; the peer is logged beside."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, {"admin_port": 0, "trusted_proxies": ["127.0.0.0/8"]}) as (
            api,
            _,
            _,
        ),
        aiohttp.ClientSession() as session,
    ):
        headers = {**AUTH, "X-Forwarded-For": "6.6.6.6, 198.51.100.7"}
        with structlog.testing.capture_logs() as events:
            async with session.post(api + "/v1/chat/completions", json=CHAT, headers=headers):
                pass
        line = next(e for e in events if e["event"] == "request")
        assert (line["client"], line["peer"]) == ("198.51.100.7", "127.0.0.1")


async def test_admin_config_shows_what_runs_and_what_waits_for_a_restart(tmp_path: Path) -> None:
    """The running configuration with secrets masked and its digest; after a reload that
    changes the port, the port waits for a restart and the last reload is not a success."""
    channel = {"api_key": KEY, "headers": {"Authorization": "Bearer instance-secret"}}
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, {"admin_port": 0, "port": 0}, tmp_path) as (_, admin, app),
        aiohttp.ClientSession(headers=AUTH) as session,
    ):
        urls, gateway = [s.url for s in sims], {"gateway": {"admin_port": 0}}
        write_config(tmp_path, urls, sections=gateway, channel=channel)  # headers differ
        text = (tmp_path / "config.toml").read_text().replace("\nport = 0", "\nport = 18181")
        (tmp_path / "config.toml").write_text(text)
        assert reload(app)
        async with session.get(admin + "/admin/config") as resp:
            assert resp.status == 200
            body = await resp.json()
        async with session.get(admin + "/metrics") as resp:
            metrics = await resp.text()
        async with (
            aiohttp.ClientSession() as anonymous,
            anonymous.get(admin + "/admin/config") as r,
        ):
            assert r.status == 401
    assert body["waiting_for_restart"] == ["gateway.port"]
    assert body["config"]["gateway"]["port"] == 0  # the running value
    assert body["settings"]["channel"]["headers"] == {"Authorization": "**********"}
    assert KEY not in json.dumps(body)
    assert "instance-secret" not in json.dumps(body)
    assert f'gateway_config_info{{hash="{body["digest"]}"}} 1.0' in metrics
    assert "gateway_config_last_reload_successful 0.0" in metrics


async def test_an_instance_down_says_why_in_the_log_metrics_and_admin() -> None:
    """A /health answering 503: instance_down with the reason, counted by reason, and the
    reason among the instance's recent errors."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, {"admin_port": 0}) as (_, admin, app),
        aiohttp.ClientSession(headers=AUTH) as session,
    ):
        await until_up(app)
        sims[0].faults.health_status = 503
        with structlog.testing.capture_logs() as events:
            await until_down(app)
        async with session.get(admin + "/admin/instances") as resp:
            instance = (await resp.json())["instances"][0]
        async with session.get(admin + "/metrics") as resp:
            metrics = await resp.text()
    down = next(e for e in events if e["event"] == "instance_down")
    assert down["reason"] == "status_503"
    assert "probe: status_503" in [e["error"] for e in instance["recent_errors"]]
    assert all(e["at"].endswith("+00:00") for e in instance["recent_errors"])
    # When it went down, and its failed probes: a runbook reads these, not the requests'.
    assert instance["state"] == "down"
    assert instance["state_since"] is not None
    assert instance["consecutive_probe_failures"] >= 1
    assert instance["probe_failures_total"] >= instance["consecutive_probe_failures"]
    assert 'check="probe",reason="status_503"' in metrics


async def until_up(app: web.Application) -> None:
    async with asyncio.timeout(10):
        while not all(s.up for s in app[DISPATCHER].scheduler.instances.states):
            await asyncio.sleep(0.05)


async def until_down(app: web.Application) -> None:
    async with asyncio.timeout(10):
        while any(s.up for s in app[DISPATCHER].scheduler.instances.states):
            await asyncio.sleep(0.05)


async def test_probes_get_in_when_the_api_clients_hold_every_connection() -> None:
    """With max_client_connections held by idle API clients, the admin port still answers."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, {"admin_port": 0, "max_client_connections": 3}) as (api, admin, _),
    ):
        host, port = api.removeprefix("http://").split(":")
        held = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
        try:
            await asyncio.sleep(0.1)
            async with aiohttp.ClientSession() as session, session.get(admin + "/readyz") as r:
                assert r.status == 200
        finally:
            for _, writer in held:
                writer.close()


async def test_a_model_nobody_serves_is_counted_as_other_and_split_xff_is_joined() -> None:
    """A 404 model_not_found counts as model="other"; a client's own X-Forwarded-For line
    beside the balancer's does not name the client."""
    trusted = {"admin_port": 0, "trusted_proxies": ["127.0.0.0/8"]}
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, trusted) as (api, admin, _),
        aiohttp.ClientSession() as session,
    ):
        body = {**CHAT, "model": "no-such-model"}
        headers = [
            *AUTH.items(),
            ("X-Forwarded-For", "6.6.6.6"),
            ("X-Forwarded-For", "198.51.100.7"),
        ]
        with structlog.testing.capture_logs() as events:
            async with session.post(api + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 404
        async with session.get(admin + "/metrics") as resp:
            metrics = await resp.text()
    line = next(e for e in events if e["event"] == "request")
    assert line["model"] == "other"
    assert line["client"] == "198.51.100.7"
    assert 'model="other",route="chat.completions",status="404"' in metrics
