"""Discovery by DNS through the gateway, with a resolver the test controls: instances that
appear take traffic once up, one that goes away finishes its stream and takes nothing new
(its series leave /metrics), a failing resolver keeps the last set, an empty answer empties
the fleet only once it has held; and with the system's resolver (localhost, from /etc/hosts)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import structlog
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.fleet.discovery import EMPTY_ROUNDS, ResolveFailed
from gateway.sim.sim_vllm import SimConfig, SimInstance

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "vllm-headless.test.svc"
SECTIONS = {"dispatch": {"health_check_interval": 0.1, "discovery_interval": 0.1}}


class Answers:
    """The resolver: what the name resolves to now (or the failure it raises)."""

    def __init__(self) -> None:
        self.now: list[tuple[str, int]] | ResolveFailed = []
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        self.asked.append(host)
        if isinstance(self.now, ResolveFailed):
            raise self.now
        return list(self.now)


def at(*sims: SimInstance) -> list[tuple[str, int]]:
    return [("127.0.0.1", int(s.url.rsplit(":", 1)[1])) for s in sims]


def label(sim: SimInstance) -> str:
    return f"127.0.0.1:{sim.url.rsplit(':', 1)[1]}"


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def admin(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, Any]:
    async with session.get(gw.url + "/admin/instances", headers=AUTH) as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def chat(session: aiohttp.ClientSession, gw: Gateway, tokens: int = 2) -> tuple[int, str]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    body["max_tokens"] = tokens
    async with session.post(gw.base_url + "/chat/completions", json=body, headers=AUTH) as r:
        await r.read()
        return r.status, r.headers.get("X-Gateway-Instance", "")


async def text(session: aiohttp.ClientSession, gw: Gateway) -> str:
    async with session.get(gw.url + "/metrics") as resp:
        return await resp.text()


def available(gw: Gateway) -> set[str]:
    return {i.name for i in gw.dispatcher.snapshot().up()}


async def test_instances_come_and_go_with_the_names_answers() -> None:
    slow = SimConfig(decode_s_per_token=0.01, seed=2)
    answers = Answers()
    async with fleet(slow, slow) as sims:
        first, second = sims
        answers.now = at(first)
        entry = {"url": f"http://{NAME}:8000", "discover": "dns"}
        async with (
            gateway_with(sims, instances=[entry], sections=SECTIONS, resolver=answers) as gw,
            aiohttp.ClientSession() as session,
        ):
            assert answers.asked[0] == NAME
            assert gw.names() == [label(first)]  # resolved before the first request
            await until(lambda: available(gw) == {label(first)})
            assert await chat(session, gw) == (200, label(first))

            # A second address: probed, then it takes traffic.
            answers.now = at(first, second)
            await until(lambda: available(gw) == {label(first), label(second)})
            shown = await admin(session, gw)
            assert shown["discovery"][0]["addresses"] == sorted([label(first), label(second)])
            assert shown["discovery"][0]["entry"] == f"http://{NAME}:8000"

            # The first goes away while it streams: the stream ends whole, nothing new goes
            # there, and its series leave /metrics.
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "long"}],
                "max_tokens": 80,
                "stream": True,
            }
            url = gw.base_url + "/chat/completions"
            async with session.post(url, json=body, headers=AUTH) as stream:
                on = stream.headers["X-Gateway-Instance"]
                other = next(s for s in sims if label(s) != on)
                answers.now = at(other)
                await until(lambda: gw.names() == [label(other)])
                assert {(await chat(session, gw))[1] for _ in range(4)} == {label(other)}
                rest = await stream.read()
            assert rest.rstrip().endswith(b"data: [DONE]")
            assert re.search(rb'"finish_reason": ?"(length|stop)"', rest)
            # Its series leave /metrics: at once, and (for those its last stream wrote as
            # it ended) once a request's time has passed.
            gw.metrics.sweep()
            assert f'server="{on}"' in await text(session, gw)  # the stream just counted
            gw.metrics._departed[on] = 0.0  # a request's time has passed
            gw.metrics.sweep()
            metrics = await text(session, gw)
            assert f'server="{on}"' not in metrics
            assert f'server="{label(other)}"' in metrics
            assert f'server="{NAME}:8000"' not in metrics  # the entry is no instance


async def test_a_failing_resolver_keeps_the_set_and_an_empty_answer_must_hold() -> None:
    answers = Answers()
    async with fleet(SimConfig(instant=True)) as sims:
        answers.now = at(*sims)
        entry = {"url": f"http://{NAME}:8000", "discover": "dns", "name": "pool"}
        async with (
            gateway_with(sims, instances=[entry], sections=SECTIONS, resolver=answers) as gw,
            aiohttp.ClientSession() as session,
        ):
            name = f"pool@{label(sims[0])}"
            await until(lambda: available(gw) == {name})
            with structlog.testing.capture_logs() as events:
                answers.now = ResolveFailed("Temporary failure in name resolution")
                asked = len(answers.asked)
                await until(lambda: len(answers.asked) >= asked + 4)
                assert gw.names() == [name]  # kept
                assert (await chat(session, gw))[0] == 200
                state = (await admin(session, gw))["discovery"][0]
                assert state["error"] == "Temporary failure in name resolution"
                assert state["failing_since"] is not None
                assert state["failures_total"] >= 3
                async with session.get(gw.url + "/metrics") as resp:
                    metrics = await resp.text()
                failures = re.search(
                    r'gateway_discovery_failures_total\{entry="pool"\} (\S+)', metrics
                )
                assert failures is not None
                assert float(failures.group(1)) >= 3
                answers.now = at(*sims)
                await until(lambda: len(answers.asked) >= asked + 6)
            failed = [e for e in events if e["event"] == "discovery_failed"]
            assert len(failed) == 1  # logged once, not every round
            assert [e["event"] for e in events if e["event"] == "discovery_recovered"] != []

            # An empty answer: the instance stays for EMPTY_ROUNDS - 1 rounds, then goes.
            answers.now = []
            asked = len(answers.asked)
            await until(lambda: len(answers.asked) >= asked + EMPTY_ROUNDS - 1)
            await until(lambda: gw.names() == [])
            assert len(answers.asked) >= asked + EMPTY_ROUNDS
            status, _ = await chat(session, gw)
            assert status == 503
            answers.now = at(*sims)
            await until(lambda: available(gw) == {name})
            assert (await chat(session, gw))[0] == 200


async def test_the_systems_resolver_finds_localhost() -> None:
    async with fleet(SimConfig(instant=True)) as sims:
        port = sims[0].url.rsplit(":", 1)[1]
        entry = {"url": f"http://localhost:{port}", "discover": "dns"}
        async with (
            gateway_with(sims, instances=[entry], sections=SECTIONS) as gw,
            aiohttp.ClientSession() as session,
        ):
            assert f"127.0.0.1:{port}" in gw.names()
            await until(lambda: f"127.0.0.1:{port}" in available(gw))
            assert (await chat(session, gw))[0] == 200
