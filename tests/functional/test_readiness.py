"""`[gateway] readiness`: what /readyz says when the fleet is down ("fleet": 503, so a
balancer sends nothing here; "process": 200, so clients get the gateway's own 503 with
Retry-After), both 503 while draining; and with `admin_port` the probes answer on the API
port too, for balancers that check the pod's IP there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from fakes import KEY, fleet, write_config
from test_admin import two_listeners, until_down, until_up

from gateway.process.reload import reload
from gateway.server.resources import LIFECYCLE
from gateway.sim.sim_vllm import SimConfig

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


async def test_process_readiness_stays_ready_while_the_fleet_is_down() -> None:
    """With "process", /readyz is 200 on both ports with no instance up, and a request gets
    the gateway's own 503 with Retry-After in OpenAI's shape; draining makes it 503."""
    gateway = {"admin_port": 0, "readiness": "process"}
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, gateway) as (api, admin, app),
        aiohttp.ClientSession() as session,
    ):
        await until_up(app)
        sims[0].faults.health_status = 503
        await until_down(app)
        for base in (api, admin):
            status, body = await _get(session, base + "/readyz")
            assert status == 200, base
            assert body == {
                "ready": True,
                "instances_up": 0,
                "draining": False,
                "readiness": "process",
            }
            assert (await _get(session, base + "/healthz"))[0] == 200
        headers = {"Authorization": f"Bearer {KEY}"}
        async with session.post(api + "/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert r.status == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "no_instance_available"
        app[LIFECYCLE].draining = True
        for base in (api, admin):
            status, body = await _get(session, base + "/readyz")
            assert (status, body["ready"], body["draining"]) == (503, False, True), base


async def test_fleet_readiness_is_unready_while_the_fleet_is_down() -> None:
    """The default, "fleet": /readyz 200 with an instance up and 503 with none, on both
    ports; /healthz stays 200; the other operations routes stay off the API port."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, {"admin_port": 0}) as (api, admin, app),
        aiohttp.ClientSession() as session,
    ):
        await until_up(app)
        for base in (api, admin):
            assert (await _get(session, base + "/readyz"))[0] == 200, base
        sims[0].faults.health_status = 503
        await until_down(app)
        for base in (api, admin):
            status, body = await _get(session, base + "/readyz")
            assert (status, body["readiness"], body["instances_up"]) == (503, "fleet", 0)
            assert (await _get(session, base + "/healthz"))[0] == 200
        assert (await _get(session, api + "/metrics"))[0] == 404


async def test_a_reload_changes_readiness(tmp_path: Path) -> None:
    """readiness applies live: a reload from "fleet" to "process" makes a down fleet's
    pod ready again."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        two_listeners(sims, {"admin_port": 0}, tmp_path) as (api, _, app),
        aiohttp.ClientSession() as session,
    ):
        await until_up(app)
        sims[0].faults.health_status = 503
        await until_down(app)
        assert (await _get(session, api + "/readyz"))[0] == 503
        sections = {"gateway": {"admin_port": 0, "readiness": "process"}}
        write_config(tmp_path, [s.url for s in sims], sections=sections)
        assert reload(app)
        assert (await _get(session, api + "/readyz"))[0] == 200
