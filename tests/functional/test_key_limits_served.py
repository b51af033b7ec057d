"""A named key's limits in one gateway, through the real OpenAI and Anthropic SDKs: the 429
each SDK raises, the headers OpenAI's API sends (and the SDK's retry honouring
`retry-after-ms`), tokens reserved and settled, requests at once."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import structlog
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

LIMITED_KEY = "sk-limited-0123456789abcdef"
HI = [{"role": "user", "content": "hi"}]
INSTANT = SimConfig(instant=True)


@contextlib.asynccontextmanager
async def gateway(config: SimConfig = INSTANT, **limits: Any) -> AsyncIterator[Gateway]:
    keys = [{"name": "limited", "key": LIMITED_KEY, **limits}]
    async with fleet(config) as sims, gateway_with(sims, channel={"keys": keys}) as gw:
        yield gw


def client(gw: Gateway, retries: int = 0, key: str = LIMITED_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=retries)


async def chat(c: openai.AsyncOpenAI, max_tokens: int = 2) -> Any:
    # ignore_eos: the answer is all of max_tokens, whatever length it would end at itself.
    return await c.chat.completions.with_raw_response.create(
        model="sim-model", messages=HI, max_tokens=max_tokens, extra_body={"ignore_eos": True}
    )


async def test_a_key_over_its_requests_gets_openais_429_and_headers() -> None:
    """Three requests a minute: three answers count the remaining down, the fourth is the
    SDK's RateLimitError with type `requests`, code `rate_limit_exceeded` and the headers."""
    async with gateway(requests_per_minute=3) as gw, client(gw) as c:
        answers = [await chat(c) for _ in range(3)]
        with pytest.raises(openai.RateLimitError) as limited:
            await chat(c)
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"3"}
    assert re.fullmatch(r"1m0s|59\.9\d*s", answers[-1].headers["x-ratelimit-reset-requests"])
    body = limited.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["code"]) == ("requests", "rate_limit_exceeded")
    assert body["message"].startswith(
        "Rate limit reached for key 'limited' on requests per min (RPM): Limit 3, Used 3, "
        "Requested 1. Please try again in "
    )
    headers = limited.value.response.headers
    wait_ms = int(headers["retry-after-ms"])
    assert 19_000 < wait_ms <= 20_000  # one request's share of a minute
    assert headers["Retry-After"] == "20"
    assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-limit-requests"]) == (
        "0",
        "3",
    )
    assert "x-should-retry" not in headers


async def test_the_sdk_retries_after_retry_after_ms_to_the_millisecond() -> None:
    """A refused request retried by the SDK waits what `retry-after-ms` says (not the whole
    seconds of Retry-After, nor its own backoff), and then passes."""
    async with gateway(requests_per_minute=24) as gw:  # one request every 2.5 s
        async with client(gw) as c:
            for _ in range(24):
                await chat(c)
            with pytest.raises(openai.RateLimitError) as limited:
                await chat(c)
        wait = int(limited.value.response.headers["retry-after-ms"]) / 1000
        assert limited.value.response.headers["Retry-After"] == "3"
        async with client(gw, retries=1) as c:
            started = time.monotonic()
            answer = await chat(c)
            waited = time.monotonic() - started
    assert answer.http_response.status_code == 200
    assert wait - 0.3 < waited < wait + 0.4 < 2.9


async def test_tokens_are_reserved_then_settled_with_what_the_instance_counted() -> None:
    """A key of 1000 tokens a minute: a request reserving 900 leaves 100 while it runs; once
    settled with its usage (about 10), the rest comes back."""
    async with gateway(tokens_per_minute=1000) as gw, client(gw) as c:
        first = await chat(c, max_tokens=895)  # the instant simulator runs to max_tokens
        remaining_while_reserved = int(first.headers["x-ratelimit-remaining-tokens"])
        second = await chat(c, max_tokens=5)
        usage = first.parse().usage
    assert first.headers["x-ratelimit-limit-tokens"] == "1000"
    assert 90 <= remaining_while_reserved <= 100
    # The first used all its 895 output tokens plus its prompt: hardly anything is back.
    assert int(second.headers["x-ratelimit-remaining-tokens"]) <= 100 - 5
    assert usage.completion_tokens == 895


async def test_unused_tokens_come_back_when_the_answer_is_cut_short() -> None:
    """A stream reserving 900 of 1000 whose client leaves after a few tokens is charged its
    prompt and those tokens only: the rest is back for the next request."""
    slow = SimConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1e6)
    body = {"model": "sim-model", "messages": HI, "max_tokens": 900, "stream": True}
    auth = {"Authorization": f"Bearer {LIMITED_KEY}"}
    async with gateway(slow, tokens_per_minute=1000) as gw, aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body, headers=auth)
        reserved_left = int(resp.headers["x-ratelimit-remaining-tokens"])
        await resp.content.readany()
        resp.close()
        await asyncio.sleep(0.3)
        async with client(gw) as c:
            after = await chat(c, max_tokens=5)
    assert reserved_left < 100
    assert int(after.headers["x-ratelimit-remaining-tokens"]) > 950


async def test_a_request_larger_than_the_key_allows_is_not_retried() -> None:
    """More tokens than a minute's worth: 429 `tokens` saying the request is too large, with
    `x-should-retry: false`, which the SDK obeys (it sends it once)."""
    async with gateway(tokens_per_minute=100) as gw, client(gw, retries=2) as c:
        with pytest.raises(openai.RateLimitError) as limited:
            await chat(c, max_tokens=500)
        sent = gw.sims[0].stats.requests
    body = limited.value.body
    assert isinstance(body, dict)
    assert body["type"] == "tokens"
    assert (
        "Request too large for key 'limited' on tokens per min (TPM): Limit 100"
        in (body["message"])
    )
    headers = limited.value.response.headers
    assert headers["x-should-retry"] == "false"
    assert "retry-after-ms" not in headers
    assert sent == 0


async def test_requests_at_once_are_limited_and_freed_when_one_ends() -> None:
    """max_concurrent 1: while a stream runs a second request is refused; a client that
    leaves gives its place back."""
    slow = SimConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1e6)
    body = {"model": "sim-model", "messages": HI, "max_tokens": 100, "stream": True}
    auth = {"Authorization": f"Bearer {LIMITED_KEY}"}
    async with gateway(slow, max_concurrent=1) as gw, aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body, headers=auth)
        await resp.content.readany()
        async with client(gw) as c:
            with pytest.raises(openai.RateLimitError) as limited:
                await chat(c)
            resp.close()  # the stream's client leaves
            await asyncio.sleep(0.2)
            assert (await chat(c)).http_response.status_code == 200
    assert "Too many requests in progress for key 'limited': Limit 1" in str(limited.value)
    assert limited.value.response.headers["retry-after-ms"] == "1000"


async def test_a_stream_carries_the_headers_and_a_key_without_limits_none() -> None:
    """A streamed answer has the x-ratelimit headers; the unnamed key (no limits) has none."""
    async with gateway(requests_per_minute=10, tokens_per_minute=5000) as gw:
        async with client(gw) as c:
            raw = await c.chat.completions.with_raw_response.create(
                model="sim-model", messages=HI, max_tokens=2, stream=True
            )
            async for _ in raw.parse():
                pass
        async with client(gw, key=KEY) as c:
            plain = await chat(c)
    assert raw.headers["x-ratelimit-remaining-requests"] == "9"
    assert raw.headers["x-ratelimit-limit-tokens"] == "5000"
    assert not [h for h in plain.headers if h.startswith("x-ratelimit")]


async def test_the_messages_route_answers_anthropics_rate_limit_error() -> None:
    """On /v1/messages: Anthropic's rate_limit_error with retry-after, and Anthropic's
    anthropic-ratelimit-* headers on answers."""
    async with (
        gateway(requests_per_minute=1) as gw,
        anthropic.AsyncAnthropic(base_url=gw.url, api_key=LIMITED_KEY, max_retries=0) as c,
    ):
        first = await c.messages.with_raw_response.create(
            model="sim-model", max_tokens=2, messages=HI
        )
        with pytest.raises(anthropic.RateLimitError) as limited:
            await c.messages.create(model="sim-model", max_tokens=2, messages=HI)
    assert first.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert first.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    body = limited.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "rate_limit_error"
    assert limited.value.response.headers["retry-after"] == "60"


async def test_a_refusal_is_counted_and_logged_against_its_key() -> None:
    """The refused request's access line names the key, the model and the limit; the
    counter of refusals by requests rises."""
    async with gateway(requests_per_minute=1) as gw, client(gw) as c:
        await chat(c)
        with structlog.testing.capture_logs() as events, pytest.raises(openai.RateLimitError):
            await chat(c)
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
            text = await resp.text()
    (line,) = [e for e in events if e["event"] == "request"]
    assert (line["status"], line["key"], line["model"], line["refused"]) == (
        429,
        "limited",
        "sim-model",
        "requests",
    )
    wanted = 'gateway_key_requests_total{key="limited",model="sim-model",outcome="limit_requests"}'
    assert f"{wanted} 1.0" in text


async def test_admin_usage_shows_each_keys_use_limits_and_what_is_left() -> None:
    """/admin/usage (with a key, as the other admin routes) lists each key: its requests by
    outcome and tokens by model, its limits, and what is left now in this process."""
    async with (
        gateway(requests_per_minute=5, tokens_per_minute=10_000, max_concurrent=3) as gw,
        client(gw) as c,
        aiohttp.ClientSession() as s,
    ):
        answers = [(await chat(c, max_tokens=4)).parse() for _ in range(2)]
        async with s.get(gw.url + "/admin/usage") as anonymous:
            refused = anonymous.status
        async with s.get(
            gw.url + "/admin/usage", headers={"Authorization": f"Bearer {KEY}"}
        ) as resp:
            page = await resp.json()
    assert refused == 401
    default, limited = page["keys"]
    assert (default["name"], default["limits"]["requests_per_minute"]) == ("default", None)
    assert "remaining" not in default
    assert limited["limits"] == {
        "requests_per_minute": 5,
        "tokens_per_minute": 10_000,
        "max_concurrent": 3,
    }
    use = limited["usage"]["sim-model"]
    assert use["requests"] == {"ok": 2}
    assert use["prompt_tokens"] == sum(a.usage.prompt_tokens for a in answers)
    assert use["completion_tokens"] == 8
    left = limited["remaining"]
    assert (left["requests"]["remaining"], left["concurrent"]["remaining"]) == (3, 3)
    spent = use["prompt_tokens"] + 8  # the bucket refills 167 tokens a second meanwhile
    assert 10_000 - spent <= left["tokens"]["remaining"] < 10_000 - spent + 100
    assert left["counted_in"] == "process"
    assert page["since"] > 0


async def test_a_named_key_reads_admin_only_when_it_is_an_admin_key() -> None:
    """/admin/* holds the fleet's config and every key's usage: a client's named key gets
    403 there (its neighbours' use is not its to read); the unnamed key, and a named key
    with "admin": true, get in. The key's own API routes are not affected."""
    keys = [
        {"name": "client", "key": LIMITED_KEY},
        {"name": "ops", "key": "sk-ops-0123456789abcdef", "admin": True},
    ]
    async with (
        fleet(INSTANT) as sims,
        gateway_with(sims, channel={"keys": keys}) as gw,
        client(gw) as c,
        aiohttp.ClientSession() as s,
    ):
        statuses = {}
        for name, key in (("client", LIMITED_KEY), ("ops", keys[1]["key"]), ("unified", KEY)):
            for path in ("/admin/usage", "/admin/config", "/admin/instances"):
                headers = {"Authorization": f"Bearer {key}"}
                async with s.get(gw.url + path, headers=headers) as resp:
                    statuses[name, path] = resp.status
                    if resp.status == 403:
                        body = await resp.json()
                        assert body["error"]["code"] == "admin_only"
        answer = await chat(c)
    assert {k: v for k, v in statuses.items() if k[0] == "client"} == {
        ("client", p): 403 for p in ("/admin/usage", "/admin/config", "/admin/instances")
    }
    assert all(v == 200 for k, v in statuses.items() if k[0] != "client")
    assert answer.parse().choices
