"""The proxy's attempts against scripted instances: the fake upstream behind a real gateway.

Two simulated instances keep the health checks green; the proxy's own upstream is
swapped for `FakeUpstream`, so each test scripts exactly what each attempt gets back
and checks what the client sees, what was retried, and that every lease went back.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
from fake_upstream import FakeResponse, FakeUpstream
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.resources import PROXY
from gateway.sim.sim_vllm import SimConfig
from gateway.upstream.response import AttemptFailed

SSE = {"Content-Type": "text/event-stream"}
JSON = {"Content-Type": "application/json"}
BUSY = json.dumps({"object": "error", "message": "engine busy", "code": 503}).encode()
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def scripted(
    *answers: FakeResponse | AttemptFailed,
) -> AsyncIterator[tuple[Gateway, FakeUpstream]]:
    """A gateway over two healthy simulated instances whose proxy sends to `answers`."""
    async with fleet(SimConfig(), SimConfig()) as sims, gateway_with(sims) as gw:
        upstream = FakeUpstream(*answers)
        gw.app[PROXY].upstream = upstream
        yield gw, upstream


async def post(
    gw: Gateway, *, stream: bool, content: str = "hi"
) -> tuple[int, dict[str, str], bytes]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": content}]}
    body["stream"] = stream
    headers = {"Authorization": f"Bearer {KEY}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.base_url + "/chat/completions", json=body, headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.read()


def metric(gw: Gateway, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(generate_latest(gw.metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == name and set(labels.items()) <= set(sample.labels.items()):
                total += sample.value
    return total


def instances_of(gw: Gateway, upstream: FakeUpstream) -> list[str]:
    """The names of the instances the attempts went to, in order."""
    by_url = {e.url: name for name, e in gw.app[PROXY].endpoints.items()}
    return [by_url[sent.url.split("/v1/")[0]] for sent in upstream.sent]


def nothing_held(gw: Gateway) -> bool:
    return all(state.inflight == 0 for state in gw.dispatcher.scheduler.instances.states)


async def test_a_busy_instance_is_retried_elsewhere_and_its_503_never_shown() -> None:
    """A 503 "engine busy" is a failed attempt: the stream comes from the other instance."""
    async with scripted(FakeResponse(503, [BUSY], JSON), FakeResponse(200, [TOKEN, DONE], SSE)) as (
        gw,
        upstream,
    ):
        status, _, body = await post(gw, stream=True)
        assert (status, body) == (200, TOKEN + DONE)
        first, second = instances_of(gw, upstream)
        assert first != second  # a retry goes elsewhere
        assert metric(gw, "gateway_retries_total", reason="status_503") == 1
        assert nothing_held(gw)
        state = gw.dispatcher.scheduler.state
        assert state(first).busy_until is not None  # busy, not failing: a short penalty
        assert state(first).recent_errors == []
        assert state(second).busy_until is None


async def test_with_no_instance_left_the_last_instance_answer_is_passed_on() -> None:
    """After both instances answered 503, the client gets the last one's answer as sent."""
    async with scripted(FakeResponse(503, [BUSY], JSON), FakeResponse(503, [BUSY], JSON)) as (
        gw,
        upstream,
    ):
        status, headers, body = await post(gw, stream=False)
        assert (status, body) == (503, BUSY)
        assert headers["X-Gateway-Instance"] == instances_of(gw, upstream)[-1]
        assert len(upstream.sent) == 2
        assert metric(gw, "gateway_retries_refused_total", why="instances") == 1
        assert nothing_held(gw)


async def test_a_request_the_gateway_cannot_send_is_answered_at_once_and_blames_no_instance() -> (
    None
):
    """An "unsendable" attempt (a configured header or URL the gateway cannot write) would
    fail alike everywhere: 502 at once, no retry, no error against the instance."""
    answer = json.dumps({"choices": [], "usage": {"completion_tokens": 4}}).encode()
    async with scripted(
        AttemptFailed("unsendable", "a header holding a line break"),
        FakeResponse(200, [answer], JSON),
    ) as (gw, upstream):
        status, _, body = await post(gw, stream=False)
        assert status == 502
        assert b"could not send the request" in body
        assert len(upstream.sent) == 1
        assert metric(gw, "gateway_retries_total", reason="connect") == 0
        (first,) = instances_of(gw, upstream)
        state = gw.dispatcher.scheduler.state(first)
        assert (state.recent_errors, state.consecutive_failures) == ([], 0)
        assert nothing_held(gw)


async def test_an_unreachable_instance_then_a_good_one_serves_a_whole_answer() -> None:
    """A connect failure is retried; the whole answer of the next instance is the client's."""
    answer = json.dumps({"choices": [], "usage": {"completion_tokens": 4}}).encode()
    async with scripted(AttemptFailed("connect", "refused"), FakeResponse(200, [answer], JSON)) as (
        gw,
        upstream,
    ):
        status, _, body = await post(gw, stream=False)
        assert (status, body) == (200, answer)
        assert metric(gw, "gateway_retries_total", reason="connect") == 1
        first, _ = instances_of(gw, upstream)
        assert [e for _, e in gw.dispatcher.scheduler.state(first).recent_errors] == ["connect"]
        assert nothing_held(gw)


async def test_a_prefill_hop_the_gateway_cannot_send_ends_the_prefill_tries() -> None:
    """With prefill and decode roles, an "unsendable" prefill attempt would fail alike on
    every prefill instance: the request goes whole to a decode instance at once (there it
    fails alike: 502), not first to the other prefill instance."""
    roles = [("prefill", SimConfig()), ("prefill", SimConfig()), ("decode", SimConfig())]
    async with fleet(*(config for _, config in roles)) as sims:
        instances = [{"url": s.url, "role": role} for s, (role, _) in zip(sims, roles, strict=True)]
        async with gateway_with(sims, instances=instances) as gw:
            upstream = FakeUpstream(*(AttemptFailed("unsendable", "a header") for _ in range(3)))
            gw.app[PROXY].upstream = upstream
            gw.app[PROXY].prefill_hop.upstream = upstream
            status, _, _ = await post(gw, stream=False, content="word " * 3000)
            assert status == 502
            by_url = {e.url: name for name, e in gw.app[PROXY].endpoints.items()}
            went = [by_url[sent.url.split("/v1/")[0]] for sent in upstream.sent]
            roles_of = {s.url: role for s, (role, _) in zip(sims, roles, strict=True)}
            kinds = [roles_of[gw.app[PROXY].endpoints[name].url] for name in went]
            assert kinds == ["prefill", "decode"], kinds
            assert nothing_held(gw)
