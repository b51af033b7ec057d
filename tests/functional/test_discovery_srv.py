"""SRV records give the port where the name has them: an entry whose host is an SRV name
(`_service._proto.name`) stands for each target's addresses with each record's port, read
from a real DNS server on loopback that the test controls."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from dns_server import dns_server
from fakes import KEY, fleet, gateway_with

from gateway.config.schema import InstanceConfig
from gateway.fleet import discovery
from gateway.fleet.discovery import HostPort, ResolveFailed, srv_lookup
from gateway.sim.sim_vllm import SimConfig

NAME = "_http._tcp.vllm.test."


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_srv_records_give_each_targets_addresses_with_its_port() -> None:
    async with dns_server() as server:
        server.srv[NAME] = [(10, 5, 8001, "localhost."), (10, 5, 8002, "localhost.")]
        server.srv["_none._tcp.vllm.test."] = [(0, 0, 0, ".")]
        resolver = server.resolver()
        found = await srv_lookup(NAME, resolver)
        assert {("127.0.0.1", 8001), ("127.0.0.1", 8002)} <= set(found)
        assert {port for _, port in found} == {8001, 8002}
        assert await srv_lookup("_missing._tcp.vllm.test.", resolver) == []  # NXDOMAIN
        assert await srv_lookup("_none._tcp.vllm.test.", resolver) == []  # "no service"
        server.failing = True
        with pytest.raises(ResolveFailed):
            await srv_lookup(NAME, resolver)


async def test_a_gateway_finds_instances_on_the_ports_the_srv_records_give() -> None:
    async with (
        dns_server() as server,
        fleet(SimConfig(instant=True), SimConfig(instant=True)) as sims,
    ):
        server.srv[NAME] = [(0, 0, port_of(s.url), "localhost.") for s in sims]
        resolver = server.resolver()

        async def resolve(host: str, port: int) -> list[HostPort]:
            assert discovery.is_srv_name(host)
            return [hp for hp in await srv_lookup(host, resolver) if hp[0] == "127.0.0.1"]

        entry = {"url": "http://_http._tcp.vllm.test", "discover": "dns"}
        sections = {"dispatch": {"health_check_interval": 0.1, "discovery_interval": 0.1}}
        async with (
            gateway_with(sims, instances=[entry], sections=sections, resolver=resolve) as gw,
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session,
        ):
            expected = {f"127.0.0.1:{port_of(s.url)}" for s in sims}
            assert set(gw.names()) == expected
            assert server.queries[0] == "_http._tcp.vllm.test."
            async with asyncio.timeout(10):
                while {i.name for i in gw.dispatcher.snapshot().up()} != expected:
                    await asyncio.sleep(0.05)
            body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(gw.base_url + "/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["X-Gateway-Instance"] in expected


def test_an_srv_name_without_the_dns_extra_is_refused_at_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.config import schema

    monkeypatch.setattr(schema, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="dns extra"):
        InstanceConfig(url="http://_http._tcp.vllm.test", discover="dns")
    InstanceConfig(url="http://vllm.test:8000", discover="dns")  # A records need nothing
