"""Every answer carries X-Request-ID, and only an authenticated request names a metric label."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from fakes import KEY, fleet, gateway_with

from gateway.routes import Route
from gateway.server.resources import PROXY
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


async def test_malformed_http_answered_by_aiohttp_carries_a_request_id() -> None:
    """The 400 that aiohttp's own handler makes for a broken request line has an id too."""
    async with fleet(SimConfig(instant=True)) as sims, gateway_with(sims) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GARBAGE\r\n\r\n")
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
        finally:
            writer.close()
    assert head.split()[1] == b"400"
    ids = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"x-request-id:")]
    assert len(ids) == 1
    assert len(ids[0].split(b":", 1)[1].strip()) == 32


async def test_an_unexpected_error_answers_500_with_the_clients_request_id() -> None:
    """A bug that escapes every middleware is answered by aiohttp with 500, and that answer
    still carries the id the client sent (the one the log lines carry)."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):

        async def broken(request: web.Request, route: Route) -> web.StreamResponse:
            raise RuntimeError("a bug")

        gw.app[PROXY].handle = broken  # type: ignore[method-assign]
        body = {"messages": [{"role": "user", "content": "hi"}]}
        headers = {**AUTH, "X-Request-ID": "client-id-500"}
        async with session.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 500
            assert r.headers["X-Request-ID"] == "client-id-500"


async def test_the_key_is_checked_before_the_tag() -> None:
    """Without the key, a request with an invalid tag gets 401, not the tag's 400."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}]}
        bad_tag = {"X-Request-Tag": "no spaces allowed"}
        async with session.post(gw.url + "/v1/chat/completions", json=body, headers=bad_tag) as r:
            assert r.status == 401
        with_key = {**AUTH, **bad_tag}
        async with session.post(gw.url + "/v1/chat/completions", json=body, headers=with_key) as r:
            assert r.status == 400
