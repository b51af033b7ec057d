"""The simulated vLLM's Anthropic Messages API, against a real server on 127.0.0.1: the
shapes vLLM's serving.py writes, its errors, and the engine it shares with chat."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import pytest
from _sim_helpers import CHAT_URL, MakeSim, chat_body

from gateway.sim.sim_vllm import SimInstance

HELLO = [{"role": "user", "content": "hello there"}]


def body(max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": max_tokens, "messages": HELLO, **extra}


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(name, data) of each event of a stream, which must all be named."""
    out = []
    for event in raw.decode().split("\n\n"):
        if event:
            name, data = event.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def test_a_stream_is_vllms_event_sequence(
    sim: SimInstance, http: aiohttp.ClientSession
) -> None:
    """message_start (usage in, 0 out), the text block, a delta a token, the block's end,
    message_delta (stop reason, usage) and message_stop; each event names its type."""
    async with http.post(sim.url + "/v1/messages", json=body(3, stream=True)) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.read())
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] > 0
    assert "role" not in start  # vLLM dumps it with exclude_unset
    assert events[2][1]["delta"]["type"] == "text_delta"
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens"}
    assert end["usage"] == {"input_tokens": start["usage"]["input_tokens"], "output_tokens": 3}
    assert sim.stats.completed == 1


async def test_a_whole_message_and_count_tokens_agree_on_the_prompt(sim: SimInstance) -> None:
    """Through the Anthropic SDK: a whole message with usage and stop reason, and
    count_tokens counting the system prompt and the messages as the answer does."""
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    async with anthropic.AsyncAnthropic(base_url=sim.url, api_key="x", max_retries=0) as c:
        message = await c.messages.create(
            model="sim-model",
            max_tokens=4,
            system=system,
            messages=HELLO,
        )
        counted = await c.messages.count_tokens(
            model="sim-model",
            system=system,
            messages=HELLO,
        )
        plain = await c.messages.count_tokens(model="sim-model", messages=HELLO)
    assert (message.type, message.role, message.stop_reason) == (
        "message",
        "assistant",
        "max_tokens",
    )
    assert message.usage.output_tokens == 4
    assert counted.input_tokens == message.usage.input_tokens > plain.input_tokens


async def test_tools_and_a_tool_turn_are_accepted(
    sim: SimInstance, http: aiohttp.ClientSession
) -> None:
    """Tools with an input_schema, a tool_use and its tool_result validate and are answered."""
    turn = [
        {"role": "user", "content": "read a"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
    ]
    tools = [{"name": "Read", "input_schema": {"type": "object"}}]
    async with http.post(
        sim.url + "/v1/messages", json=body(2, messages=turn, tools=tools)
    ) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["usage"]["output_tokens"] == 2
    assert sim.stats.last_body == json.dumps(body(2, messages=turn, tools=tools)).encode()


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"model": "sim-model", "messages": HELLO}, "body.max_tokens"),
        (body(0), "body.max_tokens"),
        (body(messages=[{"role": "robot", "content": "x"}]), "body.messages.0.role"),
        ({"max_tokens": 1, "messages": HELLO}, "body.model"),
    ],
)
async def test_a_body_vllm_does_not_validate_is_fastapis_400_in_openais_shape(
    sim: SimInstance, http: aiohttp.ClientSession, sent: dict[str, Any], param: str
) -> None:
    """max_tokens is required (and positive), as in Anthropic's API; like every route's
    validation error it is answered in OpenAI's shape, naming the field."""
    async with http.post(sim.url + "/v1/messages", json=sent) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert (error["type"], error["code"], error["param"]) == ("Bad Request", 400, param)


async def test_what_the_messages_handler_refuses_is_in_anthropics_shape(
    sim: SimInstance, http: aiohttp.ClientSession
) -> None:
    """An unknown model, a prompt and answer longer than the context, and an engine error
    come back as Anthropic errors with vLLM's OpenAI type names."""
    async with http.post(sim.url + "/v1/messages", json={**body(), "model": "nope"}) as resp:
        assert resp.status == 404
        assert await resp.json() == {
            "type": "error",
            "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."},
        }
    async with http.post(sim.url + "/v1/messages", json=body(40_000)) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"
    sim.faults.status = 500
    async with http.post(sim.url + "/v1/messages", json=body()) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["type"] == "InternalServerError"


async def test_a_message_takes_a_running_slot_of_the_engine_chat_uses(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """One engine serves both APIs: with one slot, a message running holds a chat request
    waiting, as two chat requests would."""
    sim = await make_sim(max_num_seqs=1, decode_s_per_token=0.01)
    message = asyncio.create_task(http.post(sim.url + "/v1/messages", json=body(20)))
    while sim.stats.running == 0:
        await asyncio.sleep(0.005)
    chat = asyncio.create_task(http.post(sim.url + CHAT_URL, json=chat_body(max_tokens=1)))
    while sim.stats.waiting == 0:
        await asyncio.sleep(0.005)
    assert (sim.stats.running, sim.stats.waiting) == (1, 1)
    for task in (message, chat):
        resp = await task
        assert resp.status == 200
        await resp.read()
    assert sim.stats.generation_tokens == 21


async def test_an_instance_killed_mid_stream_sends_no_message_stop(
    sim: SimInstance, http: aiohttp.ClientSession
) -> None:
    """die_after_chunks cuts the stream after that many events, without message_stop."""
    sim.faults.die_after_chunks = 3
    async with http.post(sim.url + "/v1/messages", json=body(5, stream=True)) as resp:
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert sim.stats.rejected == 1
