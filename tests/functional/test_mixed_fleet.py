"""The split between the lanes on a live fleet: short prompts stay off the long prefills."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

import aiohttp
import structlog
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig

CARD = SimConfig(decode_s_per_token=0.004, prefill_tokens_per_s=20000, max_num_seqs=8)
_ids = itertools.count()
SHORT = "hi " * 10  # ~10 tokens
LONG = "tell me " * 1200  # ~2,400 tokens, over the 400-token threshold below


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

        # Each prompt starts differently, so no prefix looks cached (affinity.py).
        prompts = [f"{next(_ids):08d} {p}" for _ in range(pairs) for p in (SHORT, LONG)]
        got = await asyncio.gather(*(one(p) for p in prompts))
    short = {name for name, p in zip(got, prompts, strict=True) if len(p) < len(LONG)}
    long = {name for name, p in zip(got, prompts, strict=True) if len(p) > len(LONG)}
    return short, long


@asynccontextmanager
async def _mixed_fleet(split: bool, *speeds: float) -> AsyncIterator[Gateway]:
    sections = {
        "dispatch": {"health_check_interval": 0.1, "max_num_seqs": 8},
        "prefill": {"long_input_threshold": 400, "max_long_per_instance": 2, "lane_split": split},
    }
    cards = [replace(CARD, speed=s) for s in speeds or (1.0, 1.0, 1.0)]
    async with fleet(*cards) as sims, gateway_with(sims, sections=sections) as gw:
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
        # The long lane is named by [prefill].tag there, as in metrics and logs.
        tag = {"long": "prefill"}
        assert current == {s.name: tag.get(lanes.lane(s), lanes.lane(s)) for s in states}
        shown = {
            (sample.labels["server"], sample.labels["lane"]): sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "gateway_instance_lane"
            for sample in family.samples
        }
        for name in long:
            assert shown[name, "prefill"] == 1.0
            assert shown[name, "short"] == 0.0
        for name in short:
            assert shown[name, "prefill"] == 0.0
            assert shown[name, "short"] == 1.0


async def test_with_the_split_off_both_lanes_share_every_instance() -> None:
    """lane_split = false keeps today's sharing: short and long requests meet on instances."""
    async with _mixed_fleet(split=False) as gw:
        short, long = await _mixed(gw, 20)
        assert short & long
        lanes = gw.dispatcher.scheduler.lanes
        assert {lanes.lane(s) for s in gw.dispatcher.scheduler.states} == {"any"}


async def test_the_slow_card_serves_the_short_lane() -> None:
    """On a fleet with one card at 40% speed and a mix whose work is mostly long prefill,
    the split gives the fast cards to the long lane and the slow card to the short one,
    and logs each move as a lane_split event."""
    async with _mixed_fleet(True, 1.0, 1.0, 1.0, 0.4) as gw:
        lanes = gw.dispatcher.scheduler.lanes
        states = gw.dispatcher.scheduler.states
        slow = gw.names()[3]
        with structlog.testing.capture_logs() as events:
            async with asyncio.timeout(30):
                while [lanes.lane(s) for s in states] != ["long", "long", "long", "short"]:
                    await _mixed(gw, 6)
        assert lanes.lane(gw.dispatcher.scheduler.state(slow)) == "short"
        splits = [e for e in events if e["event"] == "lane_split"]
        assert splits, "no lane_split event"
        assert splits[-1]["lanes"] == {s.name: lanes.lane(s) for s in states}
        assert all(len(e["moved"]) in (1, 2) for e in splits)


async def test_least_time_gathers_short_prompts_where_long_prefills_are_least_likely() -> None:
    """With the split off and least_time, short prompts sent while a long answer decodes
    all go to one card, the fullest (the next long prefill goes where it stalls the fewest
    answers); least_time without the shelter would spread them over the empty cards."""
    card = replace(CARD, decode_s_per_token=0.02)
    sections = {
        "dispatch": {"strategy": "least_time", "health_check_interval": 0.1, "max_num_seqs": 8},
        "prefill": {"long_input_threshold": 400, "max_long_per_instance": 1, "lane_split": False},
    }
    async with (
        fleet(card, card, card) as sims,
        gateway_with(sims, sections=sections) as gw,
        aiohttp.ClientSession() as session,
        AsyncExitStack() as streams,
    ):

        async def first_token(content: str) -> str:
            """Open a stream of 100 tokens, read to its first token, leave it running."""
            body = {
                "messages": [{"role": "user", "content": f"{next(_ids):08d} {content}"}],
                "max_tokens": 100,
                "stream": True,
            }
            resp = await streams.enter_async_context(
                session.post(
                    gw.url + "/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {KEY}"},
                )
            )
            assert resp.status == 200
            while b'"content"' not in await resp.content.readline():
                pass
            return resp.headers["X-Gateway-Instance"]

        long_card = await first_token(LONG)
        shorts = [await first_token(SHORT) for _ in range(4)]
    assert set(shorts) == {long_card}, (long_card, shorts)
