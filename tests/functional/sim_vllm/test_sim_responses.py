"""The simulated vLLM's Responses API, against a real server on 127.0.0.1: vLLM's event
sequence as the OpenAI SDK and Codex CLI read it, the whole answer, its errors, and the
engine it shares with chat."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
from _sim_helpers import CHAT_URL, MakeSim, chat_body, client_for
from fakes import KEY, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig, SimInstance

URL = "/v1/responses"
# The event types of one answer with text, in vLLM's order; the delta repeats once a token.
HEAD = ["response.created", "response.in_progress"]
OPEN = ["response.output_item.added", "response.content_part.added"]
CLOSE = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]

# A request as Codex CLI sends it (codex-rs, wire_api "responses", a provider without
# server-side storage): instructions, a message item of input_text parts, function tools,
# reasoning, store false, include and a prompt cache key vLLM does not use.
CODEX_BODY: dict[str, Any] = {
    "model": "sim-model",
    "instructions": "You are Codex, a coding agent running in the Codex CLI.",
    "input": [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "List the files in this folder."}],
        },
    ],
    "tools": [
        {
            "type": "function",
            "name": "shell",
            "description": "Runs a shell command and returns its output.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                "required": ["command"],
            },
        }
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": [],
    "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
}


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(name, data) of each event of a stream, which must all be named."""
    out = []
    for event in raw.decode().split("\n\n"):
        if event:
            name, data = event.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def stream(
    sim: SimInstance, http: aiohttp.ClientSession, body: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    async with http.post(sim.url + URL, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        return sse_events(await resp.read())


async def test_the_sdk_streams_vllms_event_sequence_and_assembles_the_text(
    sim: SimInstance,
) -> None:
    """The OpenAI SDK's responses.stream() reads every event in vLLM's order, numbered from
    0, and its accumulated final response holds the text the deltas carried."""
    async with (
        client_for(sim) as client,
        client.responses.stream(model="sim-model", input="hello", max_output_tokens=4) as events,
    ):
        seen = [event async for event in events]
        final = await events.get_final_response()
    kinds = [event.type for event in seen]
    assert kinds == HEAD + OPEN + ["response.output_text.delta"] * 4 + CLOSE
    assert [event.sequence_number for event in seen] == list(range(len(seen)))
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert final.output_text == "".join(deltas) != ""
    assert final.usage is not None
    assert final.usage.output_tokens == 4
    assert final.status == "incomplete"  # cut by max_output_tokens, as vLLM marks it
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"


async def test_the_sdk_streams_through_the_gateway() -> None:
    """Through the gateway the SDK sees the same sequence and assembles the same text."""
    fast = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
    async with fleet(fast) as sims, gateway_with(sims) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)
        async with (
            client,
            client.responses.stream(model="sim-model", input="hi", max_output_tokens=3) as events,
        ):
            kinds = [event.type async for event in events]
            final = await events.get_final_response()
    assert kinds == HEAD + OPEN + ["response.output_text.delta"] * 3 + CLOSE
    assert len(final.output_text) == 3 * 4  # every simulated token is 4 characters


async def test_codex_cli_request_gets_the_events_codex_needs_in_order(
    sim: SimInstance, http: aiohttp.ClientSession
) -> None:
    """Codex CLI's own request body: each event is named as its data's type, numbered without
    gaps; a delta comes only after output_item.added and content_part.added of its item id;
    output_item.done carries the text of the deltas; response.completed ends the stream with
    the response id and usage."""
    events = await stream(sim, http, {**CODEX_BODY, "max_output_tokens": 5})
    assert all(data["type"] == name for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kinds = [name for name, _ in events]
    assert kinds == HEAD + OPEN + ["response.output_text.delta"] * 5 + CLOSE
    added: set[str] = set()
    parts: set[str] = set()
    for name, data in events:
        if name == "response.output_item.added":
            assert data["item"]["type"] == "message"
            assert data["item"]["status"] == "in_progress"
            assert data["item"]["content"] == []
            added.add(data["item"]["id"])
        elif name == "response.content_part.added":
            assert data["item_id"] in added
            assert data["part"]["type"] == "output_text"
            assert data["part"]["text"] == ""
            parts.add(data["item_id"])
        elif name == "response.output_text.delta":
            assert data["item_id"] in parts
            assert (data["output_index"], data["content_index"]) == (0, 0)
    created, completed = events[0][1]["response"], events[-1][1]["response"]
    assert created["status"] == "in_progress"
    assert created["output"] == []
    assert created["usage"] is None
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    item = events[-2][1]["item"]
    assert item["status"] == "completed"
    assert item["content"][0]["text"] == text
    assert events[-4][1]["text"] == text  # response.output_text.done
    assert completed["id"] == created["id"]
    assert completed["id"].startswith("resp_")
    assert completed["output"] == [item]
    assert completed["usage"]["output_tokens"] == 5
    assert completed["usage"]["total_tokens"] == completed["usage"]["input_tokens"] + 5
    assert completed["tools"] == CODEX_BODY["tools"]
    assert completed["instructions"] == CODEX_BODY["instructions"]


async def test_the_whole_answer_is_the_response_the_stream_completes_with(
    sim: SimInstance, http: aiohttp.ClientSession
) -> None:
    """Without stream the answer is the response object response.completed carries: same
    fields, same text, same usage (the ids and the time aside)."""
    body = {"model": "sim-model", "input": "hello", "max_output_tokens": 3}
    async with http.post(sim.url + URL, json=body) as resp:
        assert resp.status == 200
        whole = await resp.json()
    completed = (await stream(sim, http, body))[-1][1]["response"]
    for answer in (whole, completed):
        answer.pop("id")
        answer.pop("created_at")
        for item in answer["output"]:
            item.pop("id")
    assert whole == completed
    assert whole["object"] == "response"
    assert whole["output"][0]["content"][0]["text"]
    assert whole["max_output_tokens"] == 3


async def test_unknown_previous_response_id_is_vllms_404(
    sim: SimInstance, http: aiohttp.ClientSession
) -> None:
    """vLLM stores no responses by default: any previous_response_id is not found."""
    body = {"model": "sim-model", "input": "hi", "previous_response_id": "resp_123"}
    async with http.post(sim.url + URL, json=body) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert error["message"] == "Response with id 'resp_123' not found."
    assert error["param"] == "response_id"


async def test_a_body_without_input_is_a_400(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """`input` is required, and a max_output_tokens past the context is refused."""
    async with http.post(sim.url + URL, json={"model": "sim-model"}) as resp:
        assert resp.status == 400
        assert "input" in (await resp.json())["error"]["message"]
    too_long = {"model": "sim-model", "input": "hi", "max_output_tokens": 10**6}
    async with http.post(sim.url + URL, json=too_long) as resp:
        assert resp.status == 400
        assert "maximum context length" in (await resp.json())["error"]["message"]


async def test_a_response_queues_in_the_engine_behind_a_chat(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """A response is generated by the instance's engine: with one slot taken by a chat it
    waits, and it runs once the chat is done."""
    sim = await make_sim(max_num_seqs=1, decode_s_per_token=0.02)
    chat = asyncio.create_task(http.post(sim.url + CHAT_URL, json=chat_body(15)))
    while sim.stats.running == 0:
        await asyncio.sleep(0.005)
    body = {"model": "sim-model", "input": "hi", "max_output_tokens": 2}
    answer = asyncio.create_task(http.post(sim.url + URL, json=body))
    while sim.stats.waiting == 0:
        await asyncio.sleep(0.005)
    assert not answer.done()
    async with await chat as first, await answer as second:
        assert first.status == second.status == 200
        assert (await second.json())["usage"]["output_tokens"] == 2
    assert sim.stats.completed == 2


async def test_a_server_dying_mid_stream_sends_no_response_completed(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """Faults.die_after_chunks cuts the stream after that many events: no completion."""
    sim = await make_sim()
    sim.faults.die_after_chunks = 4
    body = {"model": "sim-model", "input": "hi", "max_output_tokens": 5, "stream": True}
    async with http.post(sim.url + URL, json=body) as resp:
        raw = b""
        try:
            async for chunk in resp.content.iter_any():
                raw += chunk
        except aiohttp.ClientPayloadError:
            pass
    kinds = [name for name, _ in sse_events(raw)]
    assert kinds == HEAD + OPEN
    assert sim.stats.rejected == 1
