"""Short and long prompts on a live fleet of shared instances: both lanes meet on every
card, and least_time keeps short prompts where the next long prefill is least likely."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

import aiohttp
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
async def _mixed_fleet() -> AsyncIterator[Gateway]:
    sections = {
        "dispatch": {"health_check_interval": 0.1, "max_num_seqs": 8},
        "prefill": {"long_input_threshold": 400, "max_long_per_instance": 2},
    }
    async with fleet(CARD, CARD, CARD) as sims, gateway_with(sims, sections=sections) as gw:
        yield gw


async def test_both_lanes_share_every_instance() -> None:
    """Shared instances serve both lanes: short and long requests meet on instances, and
    gateway_instance_lane shows each serving both."""
    async with _mixed_fleet() as gw:
        short, long = await _mixed(gw, 20)
        assert short & long
        async with aiohttp.ClientSession() as s:
            text = await (await s.get(gw.url + "/metrics")).text()
    shown = {
        (sample.labels["server"], sample.labels["lane"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "gateway_instance_lane"
        for sample in family.samples
    }
    # The long lane is named by [prefill].tag there, as in metrics and logs.
    assert shown == {(name, lane): 1.0 for name in gw.names() for lane in ("short", "prefill")}


async def test_least_time_gathers_short_prompts_where_long_prefills_are_least_likely() -> None:
    """With least_time, short prompts sent while a long answer decodes all go to one card,
    the fullest (the next long prefill goes where it stalls the fewest answers); least_time
    without the shelter would spread them over the empty cards."""
    card = replace(CARD, decode_s_per_token=0.02)
    sections = {
        "dispatch": {"strategy": "least_time", "health_check_interval": 0.1, "max_num_seqs": 8},
        "prefill": {"long_input_threshold": 400, "max_long_per_instance": 1},
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
