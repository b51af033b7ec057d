"""`GET /v1/models` carries `X-Gateway-Instance`, as every proxied answer does: the list is
the union of the up instances' own lists, so the header names each of them."""

from __future__ import annotations

import asyncio

import aiohttp
from fakes import KEY, fleet, gateway_with, until_available

from gateway.sim.sim_vllm import SimConfig

AUTH = {"Authorization": f"Bearer {KEY}"}


async def _instances(url: str) -> set[str]:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models", headers=AUTH) as resp:
        assert resp.status == 200
        return set(resp.headers["X-Gateway-Instance"].split(", "))


async def test_models_names_the_instances_whose_lists_it_merged() -> None:
    """Both instances up: both named; one down: only the other."""
    async with (
        fleet(SimConfig(instant=True), SimConfig(instant=True)) as sims,
        gateway_with(sims, sections={"dispatch": {"health_check_interval": 0.05}}) as gw,
    ):
        await until_available(gw)
        names = set(gw.names())
        assert len(names) == 2
        assert await _instances(gw.url) == names
        down = gw.dispatcher.scheduler.instances.states[0].name
        sims[0].faults.health_status = 503
        async with asyncio.timeout(10):
            while any(s.up for s in gw.dispatcher.scheduler.instances.states if s.name == down):
                await asyncio.sleep(0.05)
        assert await _instances(gw.url) == names - {down}
