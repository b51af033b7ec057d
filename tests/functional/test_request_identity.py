"""Every answer carries X-Request-ID, and only an authenticated request names a metric label."""

from __future__ import annotations

import aiohttp
import pytest
from fakes import KEY, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/v1/models", AUTH, 200),
        ("GET", "/v1/models", {}, 401),
        ("GET", "/admin/instances", AUTH, 200),
        ("GET", "/admin/instances", {}, 401),
        ("GET", "/v1/no-such-route", AUTH, 404),
        ("GET", "/v1/chat/completions", AUTH, 405),
        ("POST", "/v1/chat/completions", {}, 401),
        ("GET", "/healthz", {}, 200),
        ("GET", "/readyz", {}, 200),
        ("GET", "/metrics", {}, 200),
    ],
)
async def test_every_answer_carries_a_request_id(
    method: str, path: str, headers: dict[str, str], status: int
) -> None:
    """Answers of every route and every error path carry X-Request-ID, the client's if sane."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        async with session.request(method, gw.url + path, headers=headers) as resp:
            assert resp.status == status
            generated = resp.headers["X-Request-ID"]
            assert len(generated) == 32
        sent = {**headers, "X-Request-ID": "client-id-42"}
        async with session.request(method, gw.url + path, headers=sent) as resp:
            assert resp.headers["X-Request-ID"] == "client-id-42"
        bad = {**headers, "X-Request-ID": "no spaces allowed"}
        async with session.request(method, gw.url + path, headers=bad) as resp:
            assert resp.headers["X-Request-ID"] != "no spaces allowed"


async def test_unauthenticated_tags_do_not_use_up_the_tag_label_slots() -> None:
    """20 unauthenticated requests with invented tags, then a team's tag keeps its own label."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for i in range(25):
            headers = {"Authorization": "Bearer wrong", "X-Request-Tag": f"invented-{i}"}
            async with session.post(
                gw.url + "/v1/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status == 401
        headers = {**AUTH, "X-Request-Tag": "team-a"}
        async with session.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
        text = await (await session.get(gw.url + "/metrics")).text()
        assert 'tag="team-a"' in text
        assert "invented-" not in text
