"""With `[shared]`, a drain is the fleet's: ordered at one replica, every replica applies it
within a round and a resume at another replica ends it; Redis that cannot take the order
changes nothing (503), and a poisoned entry is counted and ignored."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
import redis.asyncio as aioredis
from fakes import KEY, Gateway, fleet, gateway_with
from redis_server import RedisServer, redis_server

from gateway.server.resources import SHARED
from gateway.sim.sim_vllm import SimConfig

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = SimConfig(instant=True)


def sections(redis: RedisServer) -> dict[str, dict[str, object]]:
    return {"shared": {"redis_url": redis.url, "publish_interval": 0.05, "ttl": 0.5}}


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def order(gw: Gateway, name: str, what: str) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession(headers=AUTH) as session,
        session.post(f"{gw.url}/admin/instances/{name}/{what}") as resp,
    ):
        return resp.status, await resp.json()


def drained(gw: Gateway) -> dict[str, float]:
    return dict(gw.dispatcher.drained)


async def test_a_drain_at_one_replica_holds_at_every_replica_until_resumed_anywhere() -> None:
    with redis_server() as redis:
        async with (
            fleet(FAST, FAST) as sims,
            gateway_with(sims, sections=sections(redis)) as a,
            gateway_with(sims, sections=sections(redis)) as b,
        ):
            await until(lambda: a.app[SHARED].peers == 1 and b.app[SHARED].peers == 1)
            name = a.names()[0]
            status, body = await order(a, name, "drain")
            assert status == 200
            assert body["fleet_wide"] is True
            await until(lambda: name in drained(b))
            assert drained(b) == drained(a)  # the same time, as ordered at A
            assert not b.dispatcher.scheduler.state(name).available(0.0)

            # A replica that joins later (or restarts) finds the drain in the store.
            async with gateway_with(sims, sections=sections(redis)) as c:
                await until(lambda: name in drained(c))

            status, body = await order(b, name, "resume")
            assert (status, body["drained"]) == (200, False)
            await until(lambda: not drained(a))


async def test_redis_that_cannot_take_the_order_changes_nothing() -> None:
    with redis_server() as redis:
        async with fleet(FAST) as sims, gateway_with(sims, sections=sections(redis)) as a:
            await until(lambda: a.app[SHARED].up is True)
            name = a.names()[0]
            redis.stop()
            status, body = await order(a, name, "drain")
            assert status == 503
            error = body["error"]
            assert isinstance(error, dict)
            assert error["code"] == "shared_store_unavailable"
            assert drained(a) == {}
            redis.start()


async def test_a_poisoned_drain_entry_is_counted_and_ignored() -> None:
    """A value that is no time, and a key of the wrong type: neither drains anything nor
    ends the rounds (the shared view stays up)."""
    with redis_server() as redis:
        async with fleet(FAST, FAST) as sims, gateway_with(sims, sections=sections(redis)) as a:
            await until(lambda: a.app[SHARED].up is True)
            first, second = a.names()
            client = aioredis.Redis.from_url(redis.url)
            try:
                await client.hset("gateway:drained", mapping={first: "soon", second: "nan"})
                rounds = a.app[SHARED].rounds
                await until(lambda: a.app[SHARED].rounds >= rounds + 3)
                assert drained(a) == {}
                assert a.app[SHARED].errors.get("malformed", 0) >= 2
                await client.delete("gateway:drained")
                await client.set("gateway:drained", "not a hash")
                rounds = a.app[SHARED].rounds
                await until(lambda: a.app[SHARED].rounds >= rounds + 3)
                assert a.app[SHARED].round_ok is True
                assert drained(a) == {}
            finally:
                await client.aclose()
