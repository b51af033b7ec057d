"""The gateway through the real OpenAI SDK, in front of simulated vLLM instances."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with (
        fleet(FAST, FAST) as sims,
        gateway_with(sims, sections={"gateway": {"base_url": "http://127.0.0.1:1/api"}}) as gw,
    ):
        yield gw


def client(gw: Gateway, key: str = KEY, **kw: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0, **kw)  # type: ignore[arg-type]


async def test_async_chat_streams_chunks_and_the_usage_chunk(gw: Gateway) -> None:
    """A streamed chat answer arrives chunk by chunk, role first, with the final usage chunk."""
    async with client(gw) as c:
        stream = await c.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) == 5
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


async def test_sync_client_chat_and_completions_not_streamed(gw: Gateway) -> None:
    """The sync SDK client gets whole chat and completion answers with usage."""

    def run() -> tuple[openai.types.chat.ChatCompletion, openai.types.Completion]:
        with openai.OpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0) as c:
            chat = c.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            completion = c.completions.create(model="sim-model", prompt="say", max_tokens=4)
            return chat, completion

    chat, completion = await asyncio.to_thread(run)
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 3
    assert chat.choices[0].message.content
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4


async def test_sync_client_streams_completions(gw: Gateway) -> None:
    """The sync SDK client streams a completion through the gateway."""

    def run() -> list[str]:
        with openai.OpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0) as c:
            stream = c.completions.create(model="sim-model", prompt="x", max_tokens=6, stream=True)
            return [chunk.choices[0].text for chunk in stream if chunk.choices]

    texts = await asyncio.to_thread(run)
    assert len(texts) == 6


async def test_models_is_the_union_of_up_instances(gw: Gateway) -> None:
    """/v1/models lists each model of the instances that are up, once."""
    async with client(gw) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == ["sim-model"]


async def test_embeddings_pass_through(gw: Gateway) -> None:
    """Embeddings reach an instance and come back whole."""
    async with client(gw) as c:
        result = await c.embeddings.create(model="sim-model", input=["a", "b"])
    assert len(result.data) == 2


async def test_wrong_key_raises_authentication_error(gw: Gateway) -> None:
    """A wrong key gets 401 invalid_api_key, which the SDK raises as AuthenticationError."""
    async with client(gw, key="sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError) as info:
            await c.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}]
            )
    assert info.value.code == "invalid_api_key"
    assert "sk-wrong" not in str(info.value)
    assert all(s.stats.requests == 0 for s in gw.sims)


async def test_missing_model_gets_default_model(gw: Gateway) -> None:
    """A request without `model` is sent with the configured default_model."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        body = await resp.json()
    assert resp.status == 200
    assert body["model"] == "sim-model"


@pytest.mark.parametrize(
    "path", ["/chat/completions", "/api/chat/completions", "/api/v1/chat/completions"]
)
async def test_bare_and_base_url_paths_are_served(gw: Gateway, path: str) -> None:
    """The routes answer at /v1, bare, and under base_url's path with and without /v1."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + path,
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert resp.status == 200, await resp.text()


async def test_tag_and_request_id_are_forwarded_and_echoed(gw: Gateway) -> None:
    """X-Request-Tag and X-Request-ID reach the instance and come back; the key does not."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
            headers={
                "Authorization": f"Bearer {KEY}",
                "X-Request-Tag": "bench-7",
                "X-Request-ID": "req-abc-123",
            },
        )
        await resp.read()
    assert resp.headers["X-Request-Tag"] == "bench-7"
    assert resp.headers["X-Request-ID"] == "req-abc-123"
    assert resp.headers["X-Gateway-Instance"] in gw.names()
    seen = [s.stats.last_headers for s in gw.sims if s.stats.requests]
    assert len(seen) == 1
    headers = {k.lower(): v for k, v in seen[0].items()}
    assert headers["x-request-tag"] == "bench-7"
    assert headers["x-request-id"] == "req-abc-123"
    assert KEY not in json.dumps(headers)


async def test_default_tag_comes_from_settings(gw: Gateway) -> None:
    """Without a client tag the tag in settings.json headers is used (none here: no header)."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY}", "X-Request-ID": "bad id with spaces"},
        )
        await resp.read()
    assert "X-Request-Tag" not in resp.headers
    # An insane request id is replaced by a fresh one, not echoed.
    assert resp.headers["X-Request-ID"] != "bad id with spaces"
    assert len(resp.headers["X-Request-ID"]) == 32


async def _raw(gw: Gateway, path: str, **kw: object) -> tuple[int, dict[str, object], object]:
    headers = {"Authorization": f"Bearer {KEY}"}
    headers.update(kw.pop("headers", {}))  # type: ignore[call-overload]
    async with (
        aiohttp.ClientSession() as s,
        s.request(kw.pop("method", "POST"), gw.url + path, headers=headers, **kw) as resp,  # type: ignore[arg-type]
    ):
        text = await resp.text()
        return resp.status, dict(resp.headers), json.loads(text) if text else None


def _is_openai_error(body: object, code: str) -> bool:
    return (
        isinstance(body, dict)
        and set(body["error"]) == {"message", "type", "param", "code"}
        and body["error"]["code"] == code
    )


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        (
            {"data": b"{not json", "headers": {"Content-Type": "application/json"}},
            400,
            "invalid_json",
        ),
        ({"data": b"[1, 2]", "headers": {"Content-Type": "application/json"}}, 400, "invalid_json"),
        (
            {"data": b"{}", "headers": {"Content-Type": "text/plain"}},
            400,
            "unsupported_content_type",
        ),
        ({"json": {}, "headers": {"X-Request-Tag": "bad tag!"}}, 400, "invalid_header"),
        ({"json": {}, "headers": {"Authorization": "Bearer nope"}}, 401, "invalid_api_key"),
        ({"json": {}, "headers": {"Authorization": "Basic abc"}}, 401, "invalid_api_key"),
    ],
)
async def test_bad_requests_get_openai_errors_and_reach_no_instance(
    gw: Gateway, kwargs: dict[str, object], status: int, code: str
) -> None:
    """Each kind of bad request gets its status and OpenAI-shaped body; no instance sees it."""
    got, _, body = await _raw(gw, "/v1/chat/completions", **kwargs)
    assert got == status
    assert _is_openai_error(body, code)
    assert all(s.stats.requests == 0 for s in gw.sims)


async def test_body_over_the_limit_gets_413() -> None:
    """A body over max_body_bytes gets 413, with Content-Length and chunked alike."""
    async with (
        fleet(FAST) as sims,
        gateway_with(sims, sections={"gateway": {"max_body_bytes": 2048}}) as gw,
    ):
        big = b'{"prompt": "' + b"x" * 4096 + b'"}'
        status, _, body = await _raw(
            gw, "/v1/completions", data=big, headers={"Content-Type": "application/json"}
        )
        assert (status, _is_openai_error(body, "request_too_large")) == (413, True)

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(8):
                yield b"x" * 1024

        status, _, body = await _raw(
            gw, "/v1/completions", data=chunked(), headers={"Content-Type": "application/json"}
        )
        assert (status, _is_openai_error(body, "request_too_large")) == (413, True)
        assert sims[0].stats.requests == 0


async def test_unknown_route_gets_openai_404(gw: Gateway) -> None:
    """An unknown path gets 404 in OpenAI's shape, naming the routes that exist."""
    status, _, body = await _raw(gw, "/v2/whatever", json={})
    assert status == 404
    assert _is_openai_error(body, "not_found")


async def test_health_ready_and_metrics_are_served_without_key(gw: Gateway) -> None:
    """/healthz, /readyz and /metrics answer without a key; metrics count requests by route."""
    async with client(gw) as c:
        await c.completions.create(model="sim-model", prompt="x", max_tokens=1)
    async with aiohttp.ClientSession() as s:
        assert (await s.get(gw.url + "/healthz")).status == 200
        ready = await s.get(gw.url + "/readyz")
        assert ready.status == 200
        assert (await ready.json())["instances_up"] == 2
        text = await (await s.get(gw.url + "/metrics")).text()
    assert (
        'gateway_requests_total{lane="short",model="sim-model",route="completions",status="200",'
        'tag="none"} 1.0' in text
    )
    assert "gateway_instance_queue_depth{" in text


async def test_admin_instances_needs_the_key_and_shows_each_instance(gw: Gateway) -> None:
    """/admin/instances is behind the key and lists each instance's state and score."""
    status, _, _ = await _raw(gw, "/admin/instances", method="GET", headers={"Authorization": ""})
    assert status == 401
    status, _, body = await _raw(gw, "/admin/instances", method="GET")
    assert status == 200
    assert isinstance(body, dict)
    assert [i["name"] for i in body["instances"]] == gw.names()
    assert all(i["state"] == "up" for i in body["instances"])
