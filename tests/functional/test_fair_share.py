"""Fair share through the gateway, with the real OpenAI SDK: a calm key's request beside
another key's flood reaches the instance next, not after the flood's queue; the service
each key had shows in /metrics and /admin/usage."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import openai
import pytest
from aiohttp import web
from fakes import KEY, Gateway, gateway_with
from prometheus_client.parser import text_string_to_metric_families
from redis_server import redis_server

from gateway.fleet.dispatcher import Dispatcher
from gateway.proxy import jsoncodec
from gateway.server.resources import DISPATCHER
from gateway.sim.sim_vllm import SimConfig, SimInstance

pytestmark = pytest.mark.slow

FLOOD_KEY = "sk-flood-0123456789abcdef"
CALM_KEY = "sk-calm-0123456789abcdefg"
KEYS = [{"name": "flood", "key": FLOOD_KEY}, {"name": "calm", "key": CALM_KEY, "share": 2}]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def fair_count(dispatcher: Dispatcher, key: str) -> float:
    """`key`'s fair-share count at `dispatcher`, fleet-wide (fairness.py): only tests ask."""
    return dispatcher.scheduler._service.count(key)


class Arrivals:
    """Who sent each chat request the instance received, in arrival order."""

    def __init__(self) -> None:
        self.users: list[str] = []

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and request.path.endswith("/chat/completions"):
            self.users.append(jsoncodec.loads(await request.read()).get("user", ""))
        return await handler(request)


@contextlib.asynccontextmanager
async def recorded(config: SimConfig) -> AsyncIterator[tuple[SimInstance, Arrivals]]:
    sim, arrivals = SimInstance(config), Arrivals()
    sim.app.middlewares.append(arrivals.middleware)
    await sim.start()
    try:
        yield sim, arrivals
    finally:
        await sim.stop()


async def chat(c: openai.AsyncOpenAI, user: str, max_tokens: int) -> None:
    await c.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        user=user,
    )


@contextlib.asynccontextmanager
async def flooding(client: openai.AsyncOpenAI, streams: int) -> AsyncIterator[None]:
    """The flood keeps `streams` requests going until the block ends."""
    stop = asyncio.Event()

    async def stream() -> None:
        while not stop.is_set():
            await chat(client, "flood", 20)

    floods = [asyncio.create_task(stream()) for _ in range(streams)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*floods)


async def calm_beside(
    gw: Gateway, arrivals: Arrivals, calm: openai.AsyncOpenAI, user: str, queued: int
) -> list[str]:
    """Once the flood is under way and `queued` of its requests wait at `gw`, one calm
    request: who reached the instance from then on, up to and including it."""
    while len(arrivals.users) < 8:  # past the start, when all the streams arrive at once
        await asyncio.sleep(0.01)
    while gw.app[DISPATCHER].snapshot().key_queued.get("flood", 0) < queued:
        await asyncio.sleep(0.01)
    before = len(arrivals.users)
    await chat(calm, user, 2)
    came = arrivals.users[before:]
    assert user in came
    return came


async def test_a_calm_key_reaches_the_instance_before_the_floods_queue() -> None:
    """Two running slots; the flood keeps 16 requests going (with named keys an instance
    holds none beyond its slots, so about 14 wait in the gateway). Each calm request reaches
    the instance with at most three of the flood's before it; in arrival order it would
    come after eight or more."""
    slow = SimConfig(max_num_seqs=2, decode_s_per_token=0.01, seed=3)
    async with recorded(slow) as (sim, arrivals):
        instance = {"url": sim.url, "max_num_seqs": 2}
        sections = {"dispatch": {"health_check_interval": 0.2}}
        channel = {"keys": KEYS}
        async with (
            gateway_with([sim], instances=[instance], sections=sections, channel=channel) as gw,
            openai.AsyncOpenAI(base_url=gw.base_url, api_key=FLOOD_KEY, max_retries=0) as flood,
            openai.AsyncOpenAI(base_url=gw.base_url, api_key=CALM_KEY, max_retries=0) as calm,
        ):
            async with flooding(flood, 16):
                for i in range(3):
                    came = await calm_beside(gw, arrivals, calm, f"calm-{i}", queued=8)
                    # One of the flood's (a tie goes to the older), and one or two that
                    # were placed already and still on their way.
                    assert came.index(f"calm-{i}") <= 3, came
            async with aiohttp.ClientSession() as http:
                headers = {"Authorization": f"Bearer {KEY}"}
                async with http.get(gw.url + "/metrics") as r:
                    text = await r.text()
                async with http.get(gw.url + "/admin/usage", headers=headers) as r:
                    usage = {k["name"]: k for k in (await r.json())["keys"]}
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "gateway_key_service"]
    service = {s.labels["key"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert service["flood"] > service["calm"] > 0
    assert usage["calm"]["share"] == 2.0
    assert usage["flood"]["share"] == 1.0
    assert usage["calm"]["service"] == service["calm"]
    (waits,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "gateway_key_queue_wait_seconds"
    ]
    totals = {(s.name.rsplit("_", 1)[-1], s.labels["key"]): s.value for s in waits.samples}
    mean = {key: totals["sum", key] / totals["count", key] for key in ("flood", "calm")}
    assert mean["calm"] < mean["flood"], mean  # the flood waits on its own


@contextlib.asynccontextmanager
async def flood_at_a_calm_at_b(
    config: SimConfig,
) -> AsyncIterator[tuple[Gateway, Gateway, openai.AsyncOpenAI, openai.AsyncOpenAI, Arrivals]]:
    """Two gateways sharing a view through a real Redis before one recorded instance: the
    flood's client on A, the calm key's on B."""
    with redis_server() as redis:
        async with recorded(config) as (sim, arrivals):
            instance = {"url": sim.url, "max_num_seqs": config.max_num_seqs}
            sections = {
                "dispatch": {"health_check_interval": 0.2},
                "shared": {"redis_url": redis.url, "publish_interval": 0.05},
            }
            channel = {"keys": KEYS}
            async with (
                gateway_with([sim], instances=[instance], sections=sections, channel=channel) as a,
                gateway_with([sim], instances=[instance], sections=sections, channel=channel) as b,
                openai.AsyncOpenAI(base_url=a.base_url, api_key=FLOOD_KEY, max_retries=0) as flood,
                openai.AsyncOpenAI(base_url=b.base_url, api_key=CALM_KEY, max_retries=0) as calm,
            ):
                yield a, b, flood, calm, arrivals


async def test_two_gateways_order_by_the_same_service_counts() -> None:
    """With `[shared]`, each gateway counts the service the other gave a key (published at
    the push interval): the calm key served only through B, the flood only through A."""
    fast = SimConfig(max_num_seqs=2, decode_s_per_token=0.001, seed=4)
    async with flood_at_a_calm_at_b(fast) as (a, b, flood, calm, _):
        await asyncio.gather(*(chat(flood, "flood", 8) for _ in range(6)))
        await asyncio.gather(*(chat(calm, "calm", 8) for _ in range(2)))
        at_a, at_b = a.app[DISPATCHER], b.app[DISPATCHER]
        own_a, own_b = at_a.snapshot().key_service, at_b.snapshot().key_service

        def heard() -> bool:  # the next round carries the answers' output tokens
            return fair_count(at_a, "calm") == pytest.approx(own_b["calm"] / 2) and (
                fair_count(at_b, "flood") == pytest.approx(own_a["flood"])
            )

        async with asyncio.timeout(5):
            while not heard():
                await asyncio.sleep(0.05)
    # A served the calm key nothing and B the flood nothing, yet each counts what the other
    # gave (over the key's share: calm's is 2), prompts and answers alike.
    assert own_a.get("calm", 0.0) == 0.0
    assert own_b.get("flood", 0.0) == 0.0
    assert own_b["calm"] > 2 * 8 * 2  # two answers of 8 tokens at weight 2, and prompts


async def test_a_calm_key_through_one_replica_beside_a_flood_through_another() -> None:
    """With `[shared]`, the flood comes only through A and the calm key only through B.
    A sees each place its flood frees first; it leaves the place for B's lower-count calm
    request (a push later B takes it), so each calm request reaches the instance within a
    few of the flood's, where without it every one waited out its queue time."""
    slow = SimConfig(max_num_seqs=2, decode_s_per_token=0.01, seed=5)
    async with flood_at_a_calm_at_b(slow) as (a, _, flood, calm, arrivals), flooding(flood, 12):
        for i in range(3):
            came = await calm_beside(a, arrivals, calm, f"calm-{i}", queued=6)
            # The places already promised to the flood (two running and one or two
            # on their way), then the calm request: not the six queued.
            assert came.index(f"calm-{i}") <= 4, came
