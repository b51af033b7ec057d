"""Client headers an instance relies on pass through on an allow list; nothing else does."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import structlog
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
_VALID = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with fleet(FAST) as sims, gateway_with(sims) as gw:
        yield gw


async def send(
    gw: Gateway,
    headers: dict[str, str],
    path: str = "/v1/chat/completions",
    body: dict[str, Any] | None = None,
) -> tuple[int, dict[str, str]]:
    """Post with these headers (and the key); the status and what the instance received."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + path,
            json=body if body is not None else CHAT,
            headers={"Authorization": f"Bearer {KEY}", **headers},
        ) as r,
    ):
        await r.read()
        return r.status, dict(gw.sims[0].stats.last_headers)


async def test_trace_and_rank_headers_reach_the_instance(gw: Gateway) -> None:
    """traceparent, tracestate and X-data-parallel-rank arrive at the instance unchanged."""
    status, seen = await send(
        gw,
        {
            "traceparent": TRACEPARENT,
            "tracestate": "vendor=abc,other=1",
            "X-data-parallel-rank": "3",
            "X-Request-ID": "client-id-1",
        },
    )
    assert status == 200
    assert seen["traceparent"] == TRACEPARENT
    assert seen["tracestate"] == "vendor=abc,other=1"
    assert seen["x-data-parallel-rank"] == "3"
    assert seen["x-request-id"] == "client-id-1"


@pytest.mark.parametrize("path", ["/tokenize", "/v1/responses"])
async def test_the_allow_list_holds_on_the_other_routes(gw: Gateway, path: str) -> None:
    """The same headers pass on vLLM's other routes."""
    body = {"model": "sim-model", "prompt": "x", "input": "x"}
    status, seen = await send(
        gw, {"traceparent": TRACEPARENT, "X-data-parallel-rank": "0"}, path=path, body=body
    )
    assert status == 200
    assert seen["traceparent"] == TRACEPARENT
    assert seen["x-data-parallel-rank"] == "0"


async def test_hop_by_hop_and_other_client_headers_never_pass(gw: Gateway) -> None:
    """Hop-by-hop headers, the client's key and headers off the list stay at the gateway."""
    status, seen = await send(
        gw,
        {
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=99",
            "TE": "trailers",
            "Trailer": "X-Checksum",
            "Proxy-Authorization": "Basic c2VjcmV0",
            "Proxy-Connection": "keep-alive",
            "X-Custom-Thing": "yes",
            "Cookie": "session=1",
        },
    )
    assert status == 200
    for name in (
        "x-secret-hop",
        "keep-alive",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "x-custom-thing",
        "cookie",
    ):
        assert name not in seen
    assert seen.get("connection", "") != "keep-alive, X-Secret-Hop"
    assert all(KEY not in value for value in seen.values())


@pytest.mark.parametrize("rank", ["-1", "two", "1; drop", "12345"])
async def test_a_bad_rank_is_400_before_any_instance(gw: Gateway, rank: str) -> None:
    """A data-parallel rank that is no small integer gets 400 naming the header."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {KEY}", "X-data-parallel-rank": rank},
        ) as r,
    ):
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == "X-data-parallel-rank"
    assert gw.sims[0].stats.requests == 0


async def test_without_traceparent_the_gateway_starts_a_trace_and_logs_it(gw: Gateway) -> None:
    """No traceparent: the instance gets a fresh sampled one whose trace id the access log has."""
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as events:
        status, seen = await send(gw, {})
    assert status == 200
    assert _VALID.fullmatch(seen["traceparent"])
    trace_id = seen["traceparent"].split("-")[1]
    assert seen["traceparent"].endswith("-01")
    assert "tracestate" not in seen
    (line,) = [e for e in events if e["event"] == "request"]
    assert line["trace_id"] == trace_id
    assert line["request_id"]


async def test_a_client_trace_id_is_logged(gw: Gateway) -> None:
    """The client's trace id is the one bound into the request's log lines."""
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as events:
        await send(gw, {"traceparent": TRACEPARENT})
    (line,) = [e for e in events if e["event"] == "request"]
    assert line["trace_id"] == TRACEPARENT.split("-")[1]


async def test_a_malformed_traceparent_is_replaced_and_its_tracestate_dropped(
    gw: Gateway,
) -> None:
    """A traceparent that breaks the W3C format is not passed on; a fresh trace is."""
    bad = "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
    status, seen = await send(gw, {"traceparent": bad, "tracestate": "a=1"})
    assert status == 200
    assert seen["traceparent"] != bad
    assert _VALID.fullmatch(seen["traceparent"])
    assert "tracestate" not in seen
