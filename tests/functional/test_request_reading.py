"""Request fields read as vLLM reads them: lax `stream`, and the lane of images and tools."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig, SimInstance

CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Slow enough decode that a relayed stream shows its first token long before its last.
DECODING = SimConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1e6)
TOKENS = 10
FAST = SimConfig(instant=True)


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with (
        fleet(DECODING) as sims,
        gateway_with(sims, sections={"dispatch": {"health_check_interval": 60}}) as gw,
    ):
        yield gw


@contextlib.asynccontextmanager
async def lanes(sims: Sequence[SimInstance], prefill: dict[str, Any]) -> AsyncIterator[Gateway]:
    """A gateway with one short-lane and one long-lane instance."""
    instances = [
        {"url": sims[0].url, "lane": "short", "name": "short0"},
        {"url": sims[1].url, "lane": "long", "name": "long0"},
    ]
    sections = {"prefill": prefill, "dispatch": {"health_check_interval": 60}}
    async with gateway_with(sims, instances=instances, sections=sections) as gw:
        yield gw


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, **fields}


@pytest.mark.parametrize("flag", ["true", 1, "yes", 1.0])
async def test_lax_true_stream_is_relayed_chunk_by_chunk(gw: Gateway, flag: object) -> None:
    """`"stream": "true"` or 1 streams, as vLLM does: SSE events arrive while it generates."""
    sim = gw.sims[0]
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + CHAT, json=chat_body(stream=flag), headers=AUTH) as resp,
    ):
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Gateway-Instance"] in gw.names()
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first.startswith(b"data: {")
        # A buffered answer would come only after the instance finished generating.
        assert sim.stats.completed == 0, "the first event waited for the whole answer"
        rest = await resp.read()
    events = [e for e in (first + rest).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert len(events) >= TOKENS + 1
    assert sim.stats.completed == 1


@pytest.mark.parametrize("flag", ["false", 0, "off", None])
async def test_lax_false_stream_is_a_whole_answer(gw: Gateway, flag: object) -> None:
    """`"stream": "false"`, 0 or null get one JSON answer, as vLLM gives."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + CHAT, json=chat_body(stream=flag), headers=AUTH)
        data = await resp.json()
    assert resp.status == 200, data
    assert data["object"] == "chat.completion"
    assert data["usage"]["completion_tokens"] == TOKENS


@pytest.mark.parametrize("flag", ["nope", 2, [], {"on": True}])
async def test_invalid_stream_is_400_naming_the_field(gw: Gateway, flag: object) -> None:
    """A `stream` vLLM would refuse gets 400 in OpenAI's shape, param "stream", from the gateway."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + CHAT, json=chat_body(stream=flag), headers=AUTH)
        data = await resp.json()
    assert resp.status == 400, data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "stream"
    assert error["type"] == "invalid_request_error"
    assert json.dumps(flag)[:10] in error["message"] or repr(flag)[:10] in error["message"]
    assert gw.sims[0].stats.requests == 0  # refused without touching an instance


# An 800 KB inline photo: a PNG header saying 3000 x 2000, then 600 KB the gateway never reads.
PHOTO_HEADER = (
    b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR" + (3000).to_bytes(4, "big") + (2000).to_bytes(4, "big")
)
PHOTO = "data:image/png;base64," + base64.b64encode(PHOTO_HEADER + b"\1" * 600_000).decode()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    f"f{i}": {"type": "string", "description": "d" * 60} for i in range(500)
                },
            },
        },
    }
]


async def lane_of(gw: Gateway, body: dict[str, Any]) -> str:
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + CHAT, json={"max_tokens": 1, **body}, headers=AUTH)
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Gateway-Instance"]


def look_at(url: str) -> dict[str, Any]:
    image = {"type": "image_url", "image_url": {"url": url}}
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]}


@pytest.mark.parametrize(("pixels_per_token", "lane"), [(None, "long0"), (0, "short0")])
async def test_inline_photo_takes_the_long_lane(pixels_per_token: int | None, lane: str) -> None:
    """An 800 KB 6 MP inline photo counts its pixels (about 7,650 tokens): long lane by default."""
    assert len(PHOTO) > 800_000
    prefill = {} if pixels_per_token is None else {"image_pixels_per_token": pixels_per_token}
    async with fleet(FAST, FAST) as sims, lanes(sims, prefill) as gw:
        assert await lane_of(gw, look_at(PHOTO)) == lane
        assert await lane_of(gw, chat_body()) == "short0"


@pytest.mark.parametrize(("image_tokens", "lane"), [(None, "long0"), (10, "short0")])
async def test_image_by_url_counts_the_configured_figure(
    image_tokens: int | None, lane: str
) -> None:
    """An image the gateway cannot measure counts [prefill] image_tokens (default 1,500)."""
    prefill: dict[str, Any] = {"long_input_threshold": 1000}
    if image_tokens is not None:
        prefill["image_tokens"] = image_tokens
    async with fleet(FAST, FAST) as sims, lanes(sims, prefill) as gw:
        assert await lane_of(gw, look_at("https://example.com/cat.jpg")) == lane


async def test_large_tools_request_takes_the_long_lane() -> None:
    """A 40 KB tool schema counts as its JSON text (about 10,000 tokens): long lane."""
    assert len(json.dumps(TOOLS)) > 40_000
    async with fleet(FAST, FAST) as sims, lanes(sims, {}) as gw:
        assert await lane_of(gw, chat_body(tools=TOOLS)) == "long0"
        assert await lane_of(gw, chat_body()) == "short0"
