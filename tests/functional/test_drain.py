"""Run-time drain: `POST /admin/instances/{server}/drain` takes an instance out of rotation
while a stream it serves runs on to its end; `.../resume` brings it back."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest
from fakes import KEY, Gateway, fleet, gateway_with, until_available

from gateway.sim.sim_vllm import SimConfig

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENT_KEY = "sk-client-0123456789abcdef"
INSTANCE = "X-Gateway-Instance"


async def admin(
    session: aiohttp.ClientSession, gw: Gateway, path: str, key: str = KEY
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(gw.url + path, headers=headers) as resp:
        return resp.status, await resp.json()


async def instances(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, Any]:
    async with session.get(gw.url + "/admin/instances", headers=AUTH) as resp:
        return {i["name"]: i for i in (await resp.json())["instances"]}


async def served_by(session: aiohttp.ClientSession, gw: Gateway, n: int) -> list[str]:
    """Which instance answered each of `n` concurrent short requests."""

    async def one() -> str:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = 20
        async with session.post(gw.base_url + "/chat/completions", json=body, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            await r.read()
            return r.headers[INSTANCE]

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_a_drained_instance_finishes_its_stream_and_takes_nothing_new() -> None:
    slow = SimConfig(decode_s_per_token=0.01, seed=1)
    keys = [{"name": "app", "key": CLIENT_KEY}]  # the unnamed key (KEY) is the operator's
    async with (
        fleet(slow, slow) as sims,
        gateway_with(sims, channel={"keys": keys}) as gw,
        aiohttp.ClientSession() as session,
    ):
        await until_available(gw)
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "a long answer"}],
            "max_tokens": 150,
            "stream": True,
        }
        async with session.post(gw.base_url + "/chat/completions", json=body, headers=AUTH) as s:
            busy = s.headers[INSTANCE]
            other = next(n for n in gw.names() if n != busy)
            first = await s.content.readline()
            assert first.startswith(b"data: ")
            status, answer = await admin(session, gw, f"/admin/instances/{busy}/drain")
            assert status == 200
            assert answer["name"] == busy
            assert answer["drained"] is True
            assert answer["drained_since"].endswith("+00:00")
            assert answer["fleet_wide"] is False  # no [shared]: this process's drain
            # Idempotent: draining again keeps the first time.
            again = await admin(session, gw, f"/admin/instances/{busy}/drain")
            assert again == (200, answer)
            shown = (await instances(session, gw))[busy]
            assert shown["drained"] is True
            assert shown["available"] is False
            assert shown["drained_since"] == answer["drained_since"]
            assert shown["inflight"] == 1  # the stream still runs there
            assert set(await served_by(session, gw, 6)) == {other}
            rest = await s.read()
        # The drained instance's stream ran on to its end, untouched.
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert re.search(rb'"finish_reason": ?"(length|stop)"', rest)

        status, answer = await admin(session, gw, f"/admin/instances/{busy}/resume")
        assert (status, answer["drained"], answer["drained_since"]) == (200, False, None)
        assert (await instances(session, gw))[busy]["available"] is True
        for _ in range(20):  # least busy spreads concurrent requests over both again
            if busy in await served_by(session, gw, 6):
                break
        else:
            pytest.fail("the resumed instance took no request")


async def test_drain_refuses_an_unknown_name_and_a_key_without_admin() -> None:
    keys = [{"name": "app", "key": CLIENT_KEY}]  # the unnamed key (KEY) is the operator's
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims, channel={"keys": keys}) as gw,
        aiohttp.ClientSession() as session,
    ):
        await until_available(gw)
        status, body = await admin(session, gw, "/admin/instances/nowhere:1/drain")
        assert status == 404
        assert body["error"]["code"] == "instance_not_found"
        assert gw.names()[0] in body["error"]["message"]  # says which names there are
        name = gw.names()[0]
        status, body = await admin(session, gw, f"/admin/instances/{name}/drain", CLIENT_KEY)
        assert status == 403
        assert body["error"]["code"] == "admin_only"
        assert (await instances(session, gw))[name]["drained"] is False


async def test_with_every_instance_drained_a_request_is_refused_not_held() -> None:
    """Nowhere to go: the answer is the gateway's own 503 at once, and resume serves again."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        await until_available(gw)
        name = gw.names()[0]
        assert (await admin(session, gw, f"/admin/instances/{name}/drain"))[0] == 200
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
        async with asyncio.timeout(5):
            async with session.post(
                gw.base_url + "/chat/completions", json=body, headers=AUTH
            ) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["type"] == "service_unavailable"
        assert (await admin(session, gw, f"/admin/instances/{name}/resume"))[0] == 200
        assert await served_by(session, gw, 1) == [name]
