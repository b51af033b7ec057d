"""least_time on a live fleet: a card that slows down mid-run is flagged and loses share."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.dispatch import Lane
from gateway.dispatch.least_time import LeastTime
from gateway.sim.sim_vllm import SimConfig

CARD = SimConfig(decode_s_per_token=0.004, prefill_tokens_per_s=20000, max_num_seqs=8)


async def _stream(session: aiohttp.ClientSession, gw: Gateway) -> str:
    body = {
        "messages": [{"role": "user", "content": "tell me " * 200}],
        "max_tokens": 8,
        "stream": True,
    }
    async with session.post(
        gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["X-Gateway-Instance"]


async def _run(gw: Gateway, count: int, concurrency: int = 6) -> list[str]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one() -> str:
            async with sem:
                return await _stream(session, gw)

        return list(await asyncio.gather(*(one() for _ in range(count))))


async def test_a_card_that_slows_down_is_flagged_and_loses_share() -> None:
    """After one card drops to 25% speed, least_time flags it and sends it less work."""
    async with (
        fleet(CARD, CARD, CARD) as sims,
        gateway_with(
            sims,
            sections={"dispatch": {"strategy": "least_time", "health_check_interval": 0.1}},
        ) as gw,
    ):
        slow = gw.names()[2]
        before = Counter(await _run(gw, 60))
        state = gw.dispatcher.scheduler.state(slow)
        assert not state.speed.slow
        assert state.speed.prefill.value is not None
        assert state.speed.tpot.value is not None

        sims[2].set_speed(0.25)
        after = Counter(await _run(gw, 90))
        async with asyncio.timeout(5):
            while not state.speed.slow:
                await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            text = await (await s.get(gw.url + "/metrics")).text()
        assert f'gateway_instance_slow{{server="{slow}"}} 1.0' in text
        share_before = before[slow] / 60
        share_after = after[slow] / 90
        assert share_after < share_before * 0.6, (before, after)


async def test_the_slo_section_sets_least_times_ttft_bound_per_lane() -> None:
    """least_time bounds its choice by the [slo] TTFT objective of each lane."""
    async with (
        fleet(CARD) as sims,
        gateway_with(
            sims,
            sections={
                "dispatch": {"strategy": "least_time"},
                "slo": {"ttft": 0.7, "long_ttft": 3.0},
            },
        ) as gw,
    ):
        strategy = gw.dispatcher.scheduler.strategy
        assert isinstance(strategy, LeastTime)
        assert strategy.ttft_objectives == {Lane.SHORT: 0.7, Lane.LONG: 3.0}
