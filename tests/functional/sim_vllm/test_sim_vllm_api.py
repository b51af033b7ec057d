"""What the simulated vLLM serves, against a real server on 127.0.0.1: the OpenAI API surface
through the real openai client, the stream fields it reads as vLLM does, and the fleet that
starts several."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import pytest
from _sim_helpers import CHAT_URL, MakeSim, chat_body, client_for

from gateway.sim.sim_engine import ApiError, parse_stream
from gateway.sim.sim_fleet import main as fleet_main
from gateway.sim.sim_fleet import start_fleet, stop_fleet
from gateway.sim.sim_vllm import SimConfig, SimInstance, count_message_tokens, count_tokens

# --- OpenAI API surface, through the real openai client ------------------------------------


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream_chunks(sim: SimInstance, include_usage: bool) -> None:
    """A chat stream is a role chunk, one chunk per token, then the usage chunk if asked."""
    messages: list[Any] = [{"role": "user", "content": "x" * 40}]
    async with client_for(sim) as client:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": include_usage},
        )
        chunks = [chunk async for chunk in stream]
    role, *content, last = chunks
    assert role.choices[0].delta.role == "assistant"
    assert role.choices[0].delta.content == ""
    if include_usage:
        content, usage_chunk = [*content, last][:-1], last
        assert usage_chunk.choices == []
        assert usage_chunk.usage is not None
        assert usage_chunk.usage.prompt_tokens == count_message_tokens(messages) == 14
        assert usage_chunk.usage.completion_tokens == 6
        assert usage_chunk.usage.total_tokens == 20
    else:
        content = [*content, last]
    assert len(content) == 6
    assert all(c.object == "chat.completion.chunk" and c.id == role.id for c in content)
    assert all(c.choices[0].delta.content for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * 5 + ["length"]
    assert sim.stats.completed == 1
    assert sim.stats.generation_tokens == 6


async def test_chat_and_completion_usage(sim: SimInstance) -> None:
    """Non-streaming chat and completions answer in OpenAI's shape with exact usage."""
    async with client_for(sim) as client:
        chat = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "abcdefgh"}], max_tokens=7
        )
        completion = await client.completions.create(
            model="sim-model", prompt="a" * 21, max_tokens=3
        )
        default = await client.completions.create(model="sim-model", prompt="hi")
    assert chat.object == "chat.completion"
    assert chat.id.startswith("chatcmpl-")
    assert chat.model == "sim-model"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length"
    assert count_tokens(chat.choices[0].message.content or "") == 7
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (2 + 4, 7)
    assert chat.usage.total_tokens == 13
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (6, 3)
    assert default.usage is not None
    assert default.usage.completion_tokens == sim.config.default_max_tokens
    assert sim.stats.prompt_tokens == 6 + 6 + 1
    assert (sim.stats.requests, sim.stats.completed) == (3, 3)


async def test_completion_stream_text_chunks(sim: SimInstance) -> None:
    """A completions stream carries one text chunk per token."""
    async with client_for(sim) as client:
        stream = await client.completions.create(
            model="sim-model", prompt="hello", max_tokens=4, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert len(chunks) == 4
    assert all(c.object == "text_completion" and c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_and_embeddings(sim: SimInstance) -> None:
    """The models list names the served model; embeddings give 8 floats per input."""
    async with client_for(sim) as client:
        models = [model async for model in client.models.list()]
        single = await client.embeddings.create(model="sim-model", input="some text")
        batch = await client.embeddings.create(model="sim-model", input=["a", "bbbbbbbbb"])
        encoded = await client.embeddings.create(
            model="sim-model", input="some text", encoding_format="base64"
        )
    assert [m.id for m in models] == ["sim-model"]
    assert models[0].owned_by == "vllm"
    assert len(single.data) == 1
    assert len(single.data[0].embedding) == 8
    assert [d.index for d in batch.data] == [0, 1]
    assert batch.usage.prompt_tokens == 1 + 3
    assert isinstance(encoded.data[0].embedding, str)
    assert sim.stats.generation_tokens == 0


async def test_request_errors(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """Unknown model is 404; wrong content type, bad JSON and missing fields are 400."""
    async with http.post(sim.url + CHAT_URL, json=chat_body(model="other")) as resp:
        assert resp.status == 404
        assert await resp.json() == {
            "error": {
                "message": "The model `other` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
        }
    bad: list[tuple[str, dict[str, Any]]] = [
        (CHAT_URL, {"data": json.dumps(chat_body()), "headers": {"Content-Type": "text/plain"}}),
        (CHAT_URL, {"data": b"{not json", "headers": {"Content-Type": "application/json"}}),
        (CHAT_URL, {"json": {"model": "sim-model"}}),
        ("/v1/completions", {"json": {"model": "sim-model"}}),
        ("/v1/completions", {"json": {"prompt": "x", "max_tokens": 0}}),
    ]
    for path, kwargs in bad:
        async with http.post(sim.url + path, **kwargs) as resp:
            assert resp.status == 400, (path, kwargs)
            body = await resp.json()
            assert body["error"]["type"] == "BadRequestError"
            assert body["error"]["code"] == 400


async def test_tokenize_and_health(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """/tokenize counts like count_tokens; /health is 200 with an empty body."""
    async with http.post(sim.url + "/tokenize", json={"prompt": "hello world"}) as resp:
        body = await resp.json()
    assert body["count"] == len(body["tokens"]) == count_tokens("hello world") == 3
    assert body["max_model_len"] == 32768
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    async with http.post(sim.url + "/tokenize", json={"messages": messages}) as resp:
        assert (await resp.json())["count"] == count_message_tokens(messages) == 1 + 4 + 2 + 4
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""


async def test_request_headers_recorded(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """The last /v1 request's headers and its X-Request-Id are kept; the id names the answer."""
    headers = {"X-Request-Id": "req-123", "X-Custom": "yes"}
    async with http.post(sim.url + CHAT_URL, json=chat_body(), headers=headers) as resp:
        body = await resp.json()
    assert body["id"] == "chatcmpl-req-123"
    assert sim.stats.last_headers["x-custom"] == "yes"
    assert list(sim.stats.seen_request_ids) == ["req-123"]


async def test_instant_mode_answers_at_once(make_sim: MakeSim) -> None:
    """instant=True streams every token immediately, without the timing model."""
    sim = await make_sim(instant=True, decode_s_per_token=10.0)
    started = time.monotonic()
    async with client_for(sim) as client:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=50,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    assert time.monotonic() - started < 1.0
    assert len(chunks) == 1 + 50
    assert sim.stats.completed == 1


# --- fleet -----------------------------------------------------------------------------------


async def test_fleet_starts_and_stops(http: aiohttp.ClientSession) -> None:
    """start_fleet serves each config on its own port; non-loopback hosts are refused."""
    with pytest.raises(ValueError, match="loopback"):
        await start_fleet([SimConfig()], host="0.0.0.0")
    fleet = await start_fleet([SimConfig(model="a"), SimConfig(model="b", speed=0.4)])
    try:
        assert len({instance.url for instance in fleet}) == 2
        for instance, model in zip(fleet, ["a", "b"], strict=True):
            async with http.get(instance.url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == model
    finally:
        await stop_fleet(fleet)
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.get(fleet[0].url + "/health")


def test_fleet_cli_refuses_non_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    """The fleet CLI exits with status 2 rather than listen beyond loopback."""
    assert fleet_main(["--host", "0.0.0.0", "--base-port", "0"]) == 2
    assert "non-loopback" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, (False, False)),
        ({"stream": "true"}, (True, False)),
        ({"stream": 1}, (True, False)),
        ({"stream": "Off"}, (False, False)),
        ({"stream": None}, (False, False)),
        # Options without include_usage include it: StreamOptions.include_usage defaults True.
        ({"stream": True, "stream_options": {}}, (True, True)),
        ({"stream": "yes", "stream_options": {"include_usage": "1"}}, (True, True)),
        ({"stream": True, "stream_options": {"include_usage": "no"}}, (True, False)),
        # vLLM checks options against the raw value: the string "false" is truthy there.
        ({"stream": "false", "stream_options": {"include_usage": True}}, (False, True)),
    ],
)
def test_parse_stream_reads_like_vllm(body: dict[str, Any], expected: tuple[bool, bool]) -> None:
    """The simulator reads stream fields as vLLM's lax pydantic model does."""
    assert parse_stream(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        {"stream": "nope"},
        {"stream": 2},
        {"stream": 0, "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": "yes"},
        {"stream": True, "stream_options": {"include_usage": "maybe"}},
    ],
)
def test_parse_stream_refuses_what_vllm_refuses(body: dict[str, Any]) -> None:
    """What vLLM answers 400 the simulator answers 400."""
    with pytest.raises(ApiError) as caught:
        parse_stream(body)
    assert caught.value.status == 400
