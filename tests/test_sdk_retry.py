"""The load generator retries as the OpenAI SDK does: the policy checked against the SDK's
own methods, and the client's loop against a loopback server that refuses first."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web
from fakes import serving
from openai import _base_client

from loadtest import sdk_retry
from loadtest.loadgen import Client, RequestSpec, session

HEADERS: list[dict[str, str]] = [
    {},
    {"retry-after": "1"},
    {"retry-after": "0.25"},
    {"retry-after-ms": "300", "retry-after": "7"},
    {"retry-after": "0"},
    {"retry-after": "121"},
    {"retry-after": "soon"},
    {"retry-after": "1e400"},
    {"retry-after": "inf"},
    {"retry-after": "-inf"},
    {"retry-after-ms": "nope", "retry-after": "2"},
    {"x-should-retry": "false"},
    {"x-should-retry": "true"},
]
STATUSES = [400, 401, 404, 408, 409, 422, 429, 500, 502, 503, 504]


@pytest.fixture
def sdk() -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


def test_should_retry_agrees_with_the_sdk(sdk: openai.OpenAI) -> None:
    httpx = _base_client.httpx2
    for status in STATUSES:
        for headers in HEADERS:
            theirs = sdk._should_retry(httpx.Response(status, headers=headers))
            assert sdk_retry.should_retry(status, headers) is theirs, (status, headers)


def test_delay_agrees_with_the_sdk_jitter_included(
    sdk: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    httpx = _base_client.httpx2
    options = _base_client.FinalRequestOptions.construct(method="post", url="/chat/completions")
    for retries_made in range(sdk.max_retries):
        for headers in HEADERS:
            # The SDK draws its jitter from `random.random`: give it the same draws as ours.
            monkeypatch.setattr(_base_client, "random", random.Random(retries_made).random)
            remaining = sdk.max_retries - retries_made
            theirs = sdk._calculate_retry_timeout(remaining, options, httpx.Headers(headers))
            ours = sdk_retry.delay(retries_made, headers, random.Random(retries_made))
            assert ours == pytest.approx(theirs), (retries_made, headers)
    assert sdk.max_retries == sdk_retry.SDK_MAX_RETRIES


def test_backoff_doubles_to_its_cap() -> None:
    no_jitter = random.Random()
    no_jitter.random = lambda: 0.0  # type: ignore[method-assign]
    assert [sdk_retry.delay(n, {}, no_jitter) for n in range(6)] == [0.5, 1, 2, 4, 8, 8]


@pytest.fixture
async def refusing() -> AsyncIterator[tuple[str, list[int]]]:
    """A server for each model's case: `ok` gets 429 (`retry-after-ms` 200, `Retry-After`
    1) on its first try and one streamed token on the next; `busy` always 429 with no
    delay; `bad` 400; `cut` a stream that ends before `[DONE]`. Yields its URL and the
    attempts it saw."""
    seen: list[int] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        model = (await request.json())["model"]
        seen.append(1)
        if model == "bad":
            return web.json_response({"error": {"message": "no"}}, status=400)
        if model == "busy" or (model == "ok" and len(seen) % 2):
            delay = {"retry-after-ms": "200", "Retry-After": "1"} if model == "ok" else {}
            return web.json_response({"error": {"message": "busy"}}, status=429, headers=delay)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        if model != "cut":
            await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as url:
        yield f"{url}/v1", seen


SPEC = RequestSpec(index=0, at=0.0, prompt_tokens=10, max_tokens=1, client=0)


async def test_a_refused_request_is_sent_again_and_timed_from_its_first_try(
    refusing: tuple[str, list[int]],
) -> None:
    url, seen = refusing
    async with session() as http:
        result = await Client(http, "k", model="ok", retries=2).send(url, SPEC)
    assert (result.ok, result.attempts, len(seen)) == (True, 2, 2)
    assert result.ttft is not None
    assert 0.2 <= result.ttft < 1.0  # retry-after-ms, not Retry-After, is in it
    assert result.latency is not None
    assert result.latency >= result.ttft


@pytest.mark.slow  # waits out the SDK's own backoff, over a second
async def test_retries_run_out_on_the_third_refusal(refusing: tuple[str, list[int]]) -> None:
    """Without a delay from the server: the SDK's backoff, 0.375-0.5 s then 0.75-1 s."""
    url, seen = refusing
    async with session() as http:
        result = await Client(http, "k", model="busy", retries=2).send(url, SPEC)
    assert (result.status, result.ok, result.attempts, len(seen)) == (429, False, 3, 3)
    assert result.latency is not None
    assert result.latency >= 0.375 + 0.75


async def test_no_answer_is_sent_again() -> None:
    """A refused connection (status 0) is retried, as the SDK retries connection errors."""
    async with session() as http:
        result = await Client(http, "k", retries=1).send("http://127.0.0.1:9/v1", SPEC)
    assert (result.status, result.attempts, result.ok) == (0, 2, False)
    assert result.error is not None


async def test_a_stream_that_began_is_not_sent_again(refusing: tuple[str, list[int]]) -> None:
    url, seen = refusing
    async with session() as http:
        result = await Client(http, "k", model="cut", retries=2).send(url, SPEC)
    assert (result.status, result.error, result.attempts, len(seen)) == (200, "truncated", 1, 1)


async def test_without_retries_a_refusal_is_lost(refusing: tuple[str, list[int]]) -> None:
    url, seen = refusing
    async with session() as http:
        result = await Client(http, "k", model="ok").send(url, SPEC)
    assert (result.status, result.attempts, result.ok, len(seen)) == (429, 1, False, 1)


async def test_a_client_error_is_not_sent_again(refusing: tuple[str, list[int]]) -> None:
    url, seen = refusing
    async with session() as http:
        result = await Client(http, "k", model="bad", retries=2).send(url, SPEC)
    assert (result.status, result.attempts, len(seen)) == (400, 1, 1)
