"""A named key's limits across gateways sharing a real Redis on loopback: one bucket for
the fleet (requests, tokens reserved and settled, places), and each process's own
counters while Redis is away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from fakes import KEY, Gateway, fleet, gateway_with
from redis_server import RedisServer, redis_server

from gateway.fleet.shared_limits import _bounded
from gateway.server.resources import PROXY, SHARED
from gateway.sim.sim_vllm import SimConfig

TEAM_KEY = "sk-team-a-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TEAM_KEY}"}
HI = [{"role": "user", "content": "hi"}]
INSTANT = SimConfig(instant=True)
SLOW = SimConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1e6)


def shared(redis: RedisServer) -> dict[str, dict[str, object]]:
    return {"shared": {"redis_url": redis.url, "publish_interval": 0.05, "ttl": 0.5}}


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def two_gateways(
    redis: RedisServer, config: SimConfig = INSTANT, **limits: Any
) -> AsyncIterator[tuple[Gateway, Gateway]]:
    keys = [{"name": "team-a", "key": TEAM_KEY, **limits}]
    async with (
        fleet(config) as sims,
        gateway_with(sims, sections=shared(redis), channel={"keys": keys}) as a,
        gateway_with(sims, sections=shared(redis), channel={"keys": keys}) as b,
    ):
        await until(lambda: a.app[SHARED].peers == 1 and b.app[SHARED].peers == 1)
        yield a, b


async def status_of(gw: Gateway, max_tokens: int = 2) -> tuple[int, dict[str, str]]:
    body = {"model": "sim-model", "messages": HI, "max_tokens": max_tokens}
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH) as resp,
    ):
        await resp.read()
        return resp.status, dict(resp.headers)


async def test_ten_a_minute_admits_exactly_ten_across_two_gateways() -> None:
    """30 requests at once, split over two gateways, for a key of 10 a minute: 10 answers in
    all, both gateways among them; the 20 others are 429 with what remains (nothing)."""
    with redis_server() as redis:
        async with two_gateways(redis, requests_per_minute=10) as (a, b):
            results = await asyncio.gather(*(status_of(a if i % 2 else b) for i in range(30)))
            by_gateway = [
                sum(status == 200 for status, _ in results[i::2]) for i in (1, 0)
            ]  # a's, then b's
            decided = a.app[PROXY].limiter.shared, b.app[PROXY].limiter.shared
            async with (
                aiohttp.ClientSession() as s,
                # The operator's (unnamed) key: a client's named key may not read /admin.
                s.get(a.url + "/admin/usage", headers={"Authorization": f"Bearer {KEY}"}) as resp,
            ):
                page = await resp.json()
    statuses = sorted(status for status, _ in results)
    assert statuses == [200] * 10 + [429] * 20
    assert sum(by_gateway) == 10
    assert all(by_gateway)  # each admitted some: the bucket is one, not one each
    refused = [headers for status, headers in results if status == 429]
    assert {h["x-ratelimit-remaining-requests"] for h in refused} == {"0"}
    assert all(5_000 < int(h["retry-after-ms"]) <= 6_000 for h in refused)
    assert sum(d.admitted for d in decided if d is not None) == 10  # Redis decided them all
    (team,) = [k for k in page["keys"] if k["name"] == "team-a"]
    left = team["remaining"]
    assert (left["requests"]["remaining"], left["counted_in"]) == (0, "redis")  # fleet-wide
    assert team["usage"]["sim-model"]["requests"]["ok"] == by_gateway[0]  # a's own count


async def test_a_reservation_on_one_gateway_holds_back_the_other_until_settled() -> None:
    """1000 tokens a minute: A's stream reserves 900; B's request for 200 is refused while
    it runs, and admitted once A's client left and A settled what was really used."""
    body = {"model": "sim-model", "messages": HI, "max_tokens": 895, "stream": True}
    with redis_server() as redis:
        async with (
            two_gateways(redis, SLOW, tokens_per_minute=1000) as (a, b),
            aiohttp.ClientSession() as s,
        ):
            stream = await s.post(a.url + "/v1/chat/completions", json=body, headers=AUTH)
            await stream.content.readany()
            refused, headers = await status_of(b, max_tokens=195)
            stream.close()  # its client leaves after a token or two
            await asyncio.sleep(0.3)  # A settles through Redis
            admitted, _ = await status_of(b, max_tokens=195)
    assert refused == 429
    assert int(headers["x-ratelimit-remaining-tokens"]) < 200
    assert admitted == 200


async def test_requests_at_once_are_counted_across_gateways() -> None:
    """max_concurrent 1: while A streams, B's request is refused; once A's ends, B's passes."""
    body = {"model": "sim-model", "messages": HI, "max_tokens": 100, "stream": True}
    with redis_server() as redis:
        async with (
            two_gateways(redis, SLOW, max_concurrent=1) as (a, b),
            aiohttp.ClientSession() as s,
        ):
            stream = await s.post(a.url + "/v1/chat/completions", json=body, headers=AUTH)
            await stream.content.readany()
            async with openai.AsyncOpenAI(
                base_url=b.base_url, api_key=TEAM_KEY, max_retries=0
            ) as c:
                with pytest.raises(openai.RateLimitError) as limited:
                    await c.chat.completions.create(model="sim-model", messages=HI, max_tokens=2)
                stream.close()
                await asyncio.sleep(0.3)
                answer = await c.chat.completions.create(
                    model="sim-model", messages=HI, max_tokens=2
                )
    assert "Too many requests in progress for key 'team-a'" in str(limited.value)
    assert answer.choices


async def test_with_redis_away_each_gateway_applies_the_limit_on_its_own() -> None:
    """Redis killed: no request fails for it; each gateway counts the key alone, so each
    admits the whole limit (3 a minute) and refuses the fourth."""
    with redis_server() as redis:
        async with two_gateways(redis, requests_per_minute=3) as (a, b):
            redis.stop()
            await until(lambda: a.app[SHARED].up is False and b.app[SHARED].up is False)
            per_gateway = [[(await status_of(gw))[0] for _ in range(4)] for gw in (a, b)]
            local = [gw.app[PROXY].limiter.quotas["team-a"].inflight for gw in (a, b)]
    assert per_gateway == [[200, 200, 200, 429], [200, 200, 200, 429]]
    assert local == [0, 0]  # decided and settled in each process


@pytest.mark.parametrize(
    "answer",
    [None, [1, 2, 3], [1, 10**15, 10**15, 10**15, "x", 0], [2, 10**15, 10**15, 10**15, 0, 0],
     [1, 10**15, 10**15 + 8 * 24 * 3600 * 10**6, 10**15, 0, 0],
     [1, 10**15, 10**15, 10**15, -1, 0], [1, 10**15, 10**15, 10**15, 0, -1],
     [1, 10**15, 10**15, 10**15, 0]],
)  # fmt: skip
def test_an_answer_out_of_bounds_is_refused(answer: Any) -> None:
    """What Redis answers is untrusted: anything but six bounded integers is refused."""
    with pytest.raises(ValueError, match=r"six values|integers|out of bounds|too far"):
        _bounded(answer)


async def test_a_forged_place_in_a_keys_set_is_dropped_and_counted() -> None:
    """A member written into a key's places with a far-future score would keep the key at
    429 for good: the admission drops it, admits, and counts the forgery."""
    with redis_server() as redis:
        async with two_gateways(redis, max_concurrent=1) as (a, _):
            client = aioredis.Redis.from_url(redis.url)
            try:
                await client.zadd("gateway:limit:team-a:inflight", {"evil": 99999999999999})
                status, _ = await status_of(a)
                assert await client.zscore("gateway:limit:team-a:inflight", "evil") is None
            finally:
                await client.aclose()
            assert status == 200
            assert a.app[SHARED].errors["forged_lease"] == 1
