"""The split between the lanes on a live fleet: short prompts stay off the long prefills."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from fakes import KEY, Gateway, fleet, gateway_with

from loadtest.sim_vllm import SimConfig

CARD = SimConfig(decode_s_per_token=0.004, prefill_tokens_per_s=20000, max_num_seqs=8)
SHORT = "hi " * 10  # ~10 tokens
LONG = "tell me " * 1000  # ~2,000 tokens, over the 400-token threshold below


async def _send(session: aiohttp.ClientSession, gw: Gateway, content: str) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True}
    async with session.post(
        gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["X-Gateway-Instance"]


async def _mixed(gw: Gateway, pairs: int) -> tuple[set[str], set[str]]:
    """`pairs` short and long requests interleaved, 6 at a time; the instances each class used."""
    sem = asyncio.Semaphore(6)
    async with aiohttp.ClientSession() as session:

        async def one(content: str) -> str:
            async with sem:
                return await _send(session, gw, content)

        prompts = [SHORT, LONG] * pairs
        got = await asyncio.gather(*(one(p) for p in prompts))
    short = {name for name, p in zip(got, prompts, strict=True) if p is SHORT}
    long = {name for name, p in zip(got, prompts, strict=True) if p is LONG}
    return short, long


@asynccontextmanager
async def _mixed_fleet(split: bool) -> AsyncIterator[Gateway]:
    sections = {
        "dispatch": {"health_check_interval": 0.1, "max_num_seqs": 8},
        "prefill": {"long_input_threshold": 400, "max_long_per_instance": 2, "lane_split": split},
    }
    async with fleet(CARD, CARD, CARD) as sims, gateway_with(sims, sections=sections) as gw:
        yield gw


async def test_short_requests_avoid_the_instances_busy_with_long_prefills() -> None:
    """Once the split has sized itself to the mix, short and long requests use disjoint
    instances; /admin/instances and gateway_instance_lane show who serves which lane."""
    async with _mixed_fleet(split=True) as gw:
        lanes = gw.dispatcher.scheduler.lanes
        states = gw.dispatcher.scheduler.states
        async with asyncio.timeout(20):
            while "long" not in {lanes.lane(s) for s in states}:
                await _mixed(gw, 6)
            # A round of the mix during which the split did not move (it is at rest).
            while True:
                before = lanes.held()
                short, long = await _mixed(gw, 10)
                if lanes.held() == before:
                    break
        assert short, "no short request was served"
        assert long, "no long request was served"
        assert not short & long, (short, long)
        assert all(lanes.lane(gw.dispatcher.scheduler.state(n)) == "short" for n in short)
        assert all(lanes.lane(gw.dispatcher.scheduler.state(n)) == "long" for n in long)

        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession() as s:
            admin = await (await s.get(gw.url + "/admin/instances", headers=headers)).json()
            text = await (await s.get(gw.url + "/metrics")).text()
        current = {i["name"]: i["current_lane"] for i in admin["instances"]}
        assert current == {s.name: lanes.lane(s) for s in states}
        for name in long:
            assert f'gateway_instance_lane{{instance="{name}",lane="prefill"}} 1.0' in text
            assert f'gateway_instance_lane{{instance="{name}",lane="short"}} 0.0' in text


async def test_with_the_split_off_both_lanes_share_every_instance() -> None:
    """lane_split = false keeps today's sharing: short and long requests meet on instances."""
    async with _mixed_fleet(split=False) as gw:
        short, long = await _mixed(gw, 20)
        assert short & long
        lanes = gw.dispatcher.scheduler.lanes
        assert {lanes.lane(s) for s in gw.dispatcher.scheduler.states} == {"any"}
