"""An instance that answers, but wrongly: each way, through the gateway, as a client sees it.

The instance is a tiny aiohttp app on 127.0.0.1 port 0 that is healthy for the probes and
misbehaves on `/v1/chat/completions` in one way per test: a stream without `[DONE]`, a
200 that is not an event stream, keep-alive comments instead of tokens, gzip nobody asked
for, a response header too large to parse, a usage chunk split from `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from fakes import KEY, Gateway, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.exchange import Exchange
from gateway.server.resources import PROXY

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":16}}\n\n'
DONE = b"data: [DONE]\n\n"


def token(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"t%d "}}]}\n\n' % i


@contextlib.asynccontextmanager
async def instance(
    handler: Handler, channel: dict[str, Any] | None = None
) -> AsyncIterator[Gateway]:
    """A gateway in front of one instance whose chat route is `handler`."""
    app = web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with gateway_with(
            [],
            instances=[{"url": f"http://127.0.0.1:{port}", "name": "a"}],
            sections={"dispatch": {"health_check_interval": 60}},
            channel=channel,
        ) as gw:
            yield gw
    finally:
        await runner.cleanup()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="")


async def start_stream(request: web.Request, **headers: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
    await resp.prepare(request)
    return resp


def sdk(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)


async def read_stream(client: openai.AsyncOpenAI) -> str:
    stream = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, stream=True, max_tokens=16
    )
    text = []
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    return "".join(text)


async def metric(gw: Gateway, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and set(labels.items()) <= set(sample.labels.items())
    )


def recorded(gw: Gateway) -> list[Exchange]:
    """Every finished request's Exchange, as the recorder sees it."""
    proxy = gw.app[PROXY]
    seen: list[Exchange] = []
    record = proxy.recorder.record

    def spy(ex: Exchange, duration: float) -> None:
        seen.append(ex)
        record(ex, duration)

    proxy.recorder.record = spy  # type: ignore[method-assign]
    return seen


# ---------------------------------------------------------------- token count


@pytest.mark.parametrize("split", [True, False], ids=["usage-then-done", "usage-with-done"])
async def test_token_count_does_not_depend_on_how_tcp_split_the_stream(split: bool) -> None:
    """The usage chunk's 16 tokens are counted whether [DONE] arrives with it or after it."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        for event in [ROLE, *(token(i) for i in range(16))]:
            await resp.write(event)
        if split:
            await resp.write(USAGE)
            await asyncio.sleep(0.1)  # the gateway reads the usage chunk on its own
            await resp.write(DONE)
        else:
            await resp.write(USAGE + DONE)
        return resp

    async with instance(handler) as gw, sdk(gw) as client:
        seen = recorded(gw)
        assert (await read_stream(client)).split() == [f"t{i}" for i in range(16)]
        await asyncio.sleep(0.05)
        assert [ex.tokens for ex in seen] == [16]


# ---------------------------------------------------------------- not a whole event stream


@pytest.mark.parametrize(
    "tail", [b"", b'data: {"choices":[{"delta":{"cont'], ids=["after-an-event", "mid-event"]
)
async def test_a_stream_closed_without_done_ends_with_an_in_band_error(tail: bytes) -> None:
    """A stream that closes before `data: [DONE]` gives the SDK an APIError, counted as an abort."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        for event in [ROLE, token(0), token(1), tail]:
            await resp.write(event)
        return resp  # a clean end of the chunked body, but no [DONE]

    async with instance(handler) as gw, sdk(gw) as client:
        with pytest.raises(openai.APIError) as info:
            await read_stream(client)
        assert not isinstance(info.value, openai.APIConnectionError)
        assert "ended the stream without data: [DONE]" in info.value.message
        assert await metric(gw, "gateway_stream_aborts_total", side="upstream") == 1


async def test_a_connection_cut_after_done_is_not_an_abort() -> None:
    """An instance that cuts the connection after `data: [DONE]` delivered the whole answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        await resp.write(ROLE + token(0) + DONE)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # no end of the chunked body
        return resp

    async with instance(handler) as gw, sdk(gw) as client:
        assert await read_stream(client) == "t0 "
        assert await metric(gw, "gateway_stream_aborts_total") == 0


async def test_a_200_that_is_not_an_event_stream_is_a_502_not_a_clean_200() -> None:
    """A 200 answer to a stream request with no SSE data event in it is a 502 UpstreamError."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text="<html>a proxy's error page</html>\n", content_type="text/html")

    async with instance(handler) as gw, sdk(gw) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await read_stream(client)
        assert info.value.status_code == 502
        assert "without a server-sent data event" in info.value.message


# ---------------------------------------------------------------- keep-alive comments


async def test_comments_do_not_keep_a_stream_open_past_the_silence_allowed() -> None:
    """An instance sending only `:` comments after a token is cut after timeout.read, in-band."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        await resp.write(ROLE + token(0))
        for _ in range(60):  # 6 s of keep-alives, then a clean end
            await asyncio.sleep(0.1)
            await resp.write(b":\n\n")
        await resp.write(DONE)
        return resp

    channel = {"timeout": {"connect": 2, "read": 0.5, "write": 5}}
    async with instance(handler, channel) as gw, sdk(gw) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(openai.APIError) as info:
            await read_stream(client)
        assert loop.time() - started < 3
        assert "sent no data event for 0.5s" in info.value.message
        assert await metric(gw, "gateway_stream_aborts_total", side="upstream") == 1


async def test_comments_before_the_first_token_do_not_commit_the_answer() -> None:
    """Keep-alives with no token within timeout.read give 504 (retryable), not a hung 200."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        for _ in range(60):
            await resp.write(b": ping\n\n")
            await asyncio.sleep(0.1)
        await resp.write(DONE)
        return resp

    channel = {"timeout": {"connect": 2, "read": 0.5, "write": 5}}
    async with instance(handler, channel) as gw, sdk(gw) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await read_stream(client)
        assert info.value.status_code == 504


# ---------------------------------------------------------------- Content-Encoding


async def test_a_gzip_whole_answer_reaches_the_client_intact() -> None:
    """A gzip body the gateway did not ask for is passed on with its Content-Encoding."""
    answer = {"id": "x", "object": "chat.completion", "choices": [], "usage": None}

    async def handler(request: web.Request) -> web.StreamResponse:
        body = gzip.compress(json.dumps(answer).encode())
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        return web.Response(body=body, headers=headers)

    async with (
        instance(handler) as gw,
        aiohttp.ClientSession() as session,
        session.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES},
            headers={"Authorization": f"Bearer {KEY}"},
        ) as resp,
    ):
        assert resp.status == 200
        assert resp.headers.get("Content-Encoding") == "gzip"
        assert await resp.json() == answer


async def test_a_gzip_stream_is_decoded_and_relayed_as_plain_events() -> None:
    """A gzip event stream arrives decoded, every token and the end intact."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request, **{"Content-Encoding": "gzip"})
        packer = zlib.compressobj(wbits=31)
        for event in [ROLE, *(token(i) for i in range(5)), DONE]:
            await resp.write(packer.compress(event) + packer.flush(zlib.Z_SYNC_FLUSH))
        await resp.write(packer.flush())
        return resp

    async with instance(handler) as gw, sdk(gw) as client:
        assert (await read_stream(client)).split() == [f"t{i}" for i in range(5)]
        assert await metric(gw, "gateway_stream_aborts_total") == 0


async def test_a_stream_in_an_encoding_the_gateway_cannot_decode_is_a_502() -> None:
    """A `br` stream is refused before anything is sent, naming the encoding."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request, **{"Content-Encoding": "br"})
        await resp.write(b"\x0b\x02\x80garbage")
        return resp

    async with instance(handler) as gw, sdk(gw) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await read_stream(client)
        assert info.value.status_code == 502
        assert "'br'" in info.value.message


# ---------------------------------------------------------------- response head


async def test_an_oversized_response_header_is_named_not_called_unreachable() -> None:
    """A 20 KB response header gives 502 saying the header was too large, not 503."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({}, headers={"X-Huge": "a" * 20000})

    async with instance(handler) as gw, sdk(gw) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="sim-model", messages=MESSAGES)
        assert info.value.status_code == 502
        assert "response header was too large or malformed" in info.value.message
        assert "aaaa" not in info.value.message


async def test_a_stream_whose_framing_outlasts_it_ends_at_done() -> None:
    """A Content-Length larger than the body: the client's stream still ends at [DONE], at
    once, not at the silence timeout, and the connection is not kept."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Content-Length": "100000"}
        )
        await resp.prepare(request)
        await resp.write(ROLE + token(0) + DONE)
        await asyncio.sleep(30)  # the framing promises more; nothing comes
        return resp

    async with instance(handler) as gw, aiohttp.ClientSession() as http:
        body = {"messages": MESSAGES, "stream": True}
        started = asyncio.get_running_loop().time()
        async with http.post(
            gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp:
            lines = [line async for line in resp.content if line.strip()]
        took = asyncio.get_running_loop().time() - started
        assert lines[-1] == DONE.strip() + b"\n"
        assert not any(b'"error"' in line for line in lines)
        assert took < 3  # the silence timeout here is 10 s
        pool = repr(gw.app[PROXY].upstream.pool)
        assert "paused=0" in pool
