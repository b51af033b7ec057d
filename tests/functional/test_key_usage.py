"""What each key used, counted from the instance's own usage: whole answers, streams with and
without the usage chunk asked for (the gateway asks in the client's place and keeps the
chunk back, byte for byte), Anthropic's Messages, and streams cut short."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import structlog
from fakes import Gateway, fleet, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig, SimInstance

TEAM_KEY = "sk-team-a-0123456789abcdef"
KEYS = [{"name": "team-a", "key": TEAM_KEY}]
AUTH = {"Authorization": f"Bearer {TEAM_KEY}"}
# `tools` reach the gateway's estimate but not the simulator's count, so a counter equal to
# the simulator's prompt tokens was read from its usage, not estimated.
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
CHAT = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "count my tokens, please"}],
    "tools": TOOLS,
    "max_tokens": 7,
}
SLOW = SimConfig(decode_s_per_token=0.1, prefill_tokens_per_s=1e6)


async def key_counters(gw: Gateway, key: str = "team-a") -> dict[str, float]:
    """The key's token counters and request outcomes, summed over models."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("key") != key:
                continue
            if sample.name == "gateway_key_tokens_total":
                name = sample.labels["kind"]
            elif sample.name == "gateway_key_requests_total":
                name = sample.labels["outcome"]
            else:
                continue
            found[name] = found.get(name, 0) + sample.value
    return found


@contextlib.asynccontextmanager
async def one_instance(config: SimConfig) -> AsyncIterator[tuple[Gateway, SimInstance]]:
    async with fleet(config) as sims, gateway_with(sims, channel={"keys": KEYS}) as gw:
        yield gw, sims[0]


async def post(gw_url: str, path: str, body: dict[str, Any], **headers: str) -> bytes:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url + path, json=body, headers={**AUTH, **headers}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return await resp.read()


def same_second(*bodies: bytes) -> list[bytes]:
    """The bodies with `created` (the second the answer was made in) made one value."""
    return [re.sub(rb'"created":\d+', b'"created":0', body) for body in bodies]


async def test_a_stream_without_usage_asked_reaches_the_client_as_vllm_sends_it() -> None:
    """The gateway asks vLLM for the usage chunk and keeps it back: the client gets what an
    instance of the same seed sends a direct request for the same stream, and the key is
    counted with the instance's own figures."""
    body = {**CHAT, "stream": True}
    async with (
        one_instance(SimConfig(instant=True)) as (gw, sim),
        fleet(SimConfig(instant=True)) as (direct,),
    ):
        via_gateway = await post(gw.url, "/v1/chat/completions", body, **{"X-Request-ID": "r1"})
        straight = await post(direct.url, "/v1/chat/completions", body, **{"X-Request-ID": "r1"})
        counters = await key_counters(gw)
    assert json.loads(sim.stats.last_body)["stream_options"] == {"include_usage": True}
    assert b'"usage"' not in via_gateway
    assert same_second(via_gateway) == same_second(straight)
    assert (counters["prompt"], counters["completion"]) == (
        sim.stats.prompt_tokens,
        sim.stats.generation_tokens,
    )
    assert counters["ok"] == 1


async def test_a_stream_that_asked_for_usage_keeps_its_usage_chunk() -> None:
    """A client that asked for the usage chunk gets it, and the counts come from it."""
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with one_instance(SimConfig(instant=True)) as (gw, sim):
        streamed = await post(gw.url, "/v1/chat/completions", body)
        counters = await key_counters(gw)
    usage = json.loads(streamed.split(b"data: ")[-2])["usage"]
    assert (counters["prompt"], counters["completion"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert (sim.stats.prompt_tokens, sim.stats.generation_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


async def test_whole_answers_count_their_usage_openai_and_anthropic() -> None:
    """A whole chat answer, a completion and a Messages answer (whole and streamed) through
    the SDKs add up to what the instance counted."""
    async with one_instance(SimConfig(instant=True)) as (gw, sim):
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=TEAM_KEY) as client:
            await client.chat.completions.create(**CHAT)
            await client.completions.create(model="sim-model", prompt="one two three", max_tokens=4)
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=TEAM_KEY) as claude:
            hello = [{"role": "user", "content": "hello there"}]
            await claude.messages.create(model="sim-model", max_tokens=5, messages=hello)
            async with claude.messages.stream(
                model="sim-model", max_tokens=6, messages=hello
            ) as stream:
                await stream.get_final_message()
        counters = await key_counters(gw)
    assert counters["ok"] == 4
    assert (counters["prompt"], counters["completion"]) == (
        sim.stats.prompt_tokens,
        sim.stats.generation_tokens,
    )


async def test_a_stream_cut_by_its_client_counts_what_was_relayed_and_logs_it() -> None:
    """A client that leaves mid-stream: the access line says cut by the client with the
    bytes written and the tokens relayed, which are what the instance generated; the
    prompt is the estimate (vLLM counts it only at the end), here the instance's count."""
    body = {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 200}
    async with one_instance(SLOW) as (gw, sim):
        with structlog.testing.capture_logs() as events:
            async with aiohttp.ClientSession() as s:
                resp = await s.post(
                    gw.url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH
                )
                received = b""
                while received.count(b"data:") < 4:
                    received += await resp.content.readany()
                resp.close()
            async with asyncio.timeout(5):
                while sim.stats.cancelled < 1 or not [e for e in events if e["event"] == "request"]:
                    await asyncio.sleep(0.02)
        counters = await key_counters(gw)
    (line,) = [e for e in events if e["event"] == "request"]
    assert (line["status"], line["cut"], line["key"]) == (499, "client", "team-a")
    assert line["bytes_sent"] >= len(received)
    assert line["completion_tokens"] == sim.stats.generation_tokens > 0
    assert counters["completion"] == sim.stats.generation_tokens
    assert counters["prompt"] == line["prompt_tokens"] == sim.stats.prompt_tokens
    assert counters["cut"] == 1


async def test_a_stream_ended_by_the_drain_deadline_is_logged_as_cut_with_its_tokens() -> None:
    """A stream still running when the drain time is over: status 200, cut by the drain,
    with the bytes and the tokens it relayed."""
    body = {"messages": [{"role": "user", "content": "drain me"}], "max_tokens": 200}
    async with one_instance(SLOW) as (gw, sim):
        with structlog.testing.capture_logs() as events:
            async with aiohttp.ClientSession() as s:
                resp = await s.post(
                    gw.url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH
                )
                received = await resp.content.readany()
                while received.count(b"data:") < 3:
                    received += await resp.content.readany()
                gw.lifecycle.stopping.set()
                await gw.lifecycle.drain(0.0)
                received += await resp.read()
        counters = await key_counters(gw)
    (line,) = [e for e in events if e["event"] == "request"]
    assert (line["status"], line["cut"]) == (200, "drain")
    assert line["bytes_sent"] >= len(received)
    assert b"drain time is over" in received
    relayed = received.count(b'"delta":{"content"')  # a token's chunk (not the role's)
    assert line["completion_tokens"] == counters["completion"] == relayed
    assert sim.stats.generation_tokens >= relayed
