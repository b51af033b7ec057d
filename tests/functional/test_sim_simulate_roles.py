"""`gateway --simulate` before a fleet with prefill and decode roles: the simulated instances
run vLLM's KV connector, so a long prompt goes in two hops, not one for want of params."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from fakes import KEY, gateway_with, until_available, write_config
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load as gateway_config
from gateway.process.serve import start_simulated
from gateway.sim.sim_fleet import stop_fleet
from gateway.sim.sim_vllm import SimInstance

SECTIONS = {
    "dispatch": {"health_check_interval": 0.1},
    "prefill": {"long_input_threshold": 400},
    "slo": {"tpot": 0.005},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def hops(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(url + "/metrics")).text()
    return {
        sample.labels["path"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gateway_disaggregated_requests_total"
    }


def simulated(instances: list[dict[str, Any]]) -> gateway_config.Config:
    with tempfile.TemporaryDirectory() as folder:
        return gateway_config.load(write_config(Path(folder), instances, sections=SECTIONS))


async def test_simulate_with_roles_starts_instances_with_the_kv_connector() -> None:
    """Instances with roles are simulated with kv_transfer on (all of them, kv_both); a long
    prompt's prefill hop gets params, and the decode instance reads the KV: two hops."""
    instances = [
        {"url": f"http://127.0.0.1:{free_port()}", "name": "p", "role": "prefill"},
        {"url": f"http://127.0.0.1:{free_port()}", "name": "d", "role": "decode"},
    ]
    sims = [s for s in await start_simulated(simulated(instances)) if isinstance(s, SimInstance)]
    try:
        assert [s.config.kv_transfer for s in sims] == [True, True]
        async with gateway_with(sims, instances=instances, sections=SECTIONS) as gw:
            await until_available(gw)
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "tell me more " * 300}],
                "max_tokens": 3,
            }
            auth = {"Authorization": f"Bearer {KEY}"}
            async with (
                aiohttp.ClientSession() as s,
                s.post(gw.url + "/v1/chat/completions", json=body, headers=auth) as resp,
            ):
                assert resp.status == 200, await resp.text()
            counted = await hops(gw.url)
        prefill, decode = sims
        assert counted.get("two_hop") == 1
        assert counted.get("no_params", 0) == 0
        assert prefill.stats.kv_produced == 1
        assert decode.stats.kv_transfers == 1
    finally:
        await stop_fleet(sims)


async def test_simulate_without_roles_leaves_the_connector_off() -> None:
    """A fleet of role "both" runs as before: no connector, vLLM's default limit."""
    instances = [{"url": f"http://127.0.0.1:{free_port()}"}]
    sims = [s for s in await start_simulated(simulated(instances)) if isinstance(s, SimInstance)]
    try:
        assert [s.config.kv_transfer for s in sims] == [False]
        assert sims[0].config.default_max_tokens is None
    finally:
        await stop_fleet(sims)
