"""Request migration: an instance that dies mid-stream (the simulator drops the connection
after a few chunks) and the stream goes on elsewhere; the client, the real OpenAI SDK, sees
one stream: one id, one role chunk, one finish_reason, the usage of the whole answer."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import structlog
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig, SimInstance

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
SIM = SimConfig(decode_s_per_token=0.002, seed=5)
DIES_AFTER = 6  # chunks the dying instance sends before it drops the connection
SECTIONS = {"dispatch": {"health_check_interval": 60}}


def instance_of(gw: Gateway, sim: SimInstance) -> str:
    return sim.url.split("://", 1)[1]


async def metrics_text(gw: Gateway) -> str:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        return await resp.text()


def migrations(text: str, reason: str, outcome: str) -> float:
    pattern = rf'gateway_migrations_total\{{outcome="{outcome}",reason="{reason}"\}} (\S+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


async def chat_stream(
    client: openai.AsyncOpenAI, *, usage: bool = True, **extra: Any
) -> tuple[list[Any], str]:
    """One streamed chat answer's chunks and the instance the gateway first placed it on."""
    options = {"include_usage": True} if usage else None
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-model",
        messages=[{"role": "user", "content": "tell me a long story about the sea"}],
        max_tokens=40,
        stream=True,
        stream_options=options,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, **extra},
    )
    first = raw.headers["X-Gateway-Instance"]
    return [chunk async for chunk in raw.parse()], first


async def test_a_chat_stream_goes_on_elsewhere_and_the_client_sees_one_stream() -> None:
    async with fleet(SIM, SIM) as sims:
        dying, healthy = sims
        dying.faults.die_after_chunks = DIES_AFTER
        # The dying instance first: the healthy one is tried only as the continuation.
        instances = [{"url": dying.url}, {"url": healthy.url, "weight": 0.01}]
        async with (
            gateway_with(sims, instances=instances, sections=SECTIONS) as gw,
            openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0) as client,
        ):
            with structlog.testing.capture_logs() as events:
                for _ in range(10):
                    chunks, first = await chat_stream(client)
                    if first == instance_of(gw, dying):
                        break
                else:
                    pytest.fail("no stream landed on the dying instance")
            reference = await prompt_tokens_on(healthy)
    assert {c.id for c in chunks} == {chunks[0].id}
    assert {c.created for c in chunks} == {chunks[0].created}
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(roles) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [f.choices[0].finish_reason for f in finishes] == ["length"]
    assert len(content) == 40  # ignore_eos: max_tokens in all, over both parts
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 40
    assert usage.prompt_tokens == reference  # the original prompt's, not the continuation's
    line = next(e for e in events if e["event"] == "request" and e.get("migrated"))
    assert line["migrated"] == 1
    assert line["migrated_to"] == [instance_of(gw, healthy)]
    assert line["completion_tokens"] == 40


async def prompt_tokens_on(sim: SimInstance) -> int:
    """The prompt tokens the instance itself counts for the test's request."""
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me a long story about the sea"}],
        "max_tokens": 1,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(sim.url + "/v1/chat/completions", json=body) as resp,
    ):
        answer = await resp.json()
    return int(answer["usage"]["prompt_tokens"])


async def test_a_completions_stream_goes_on_and_the_metric_counts_it() -> None:
    async with fleet(SIM, SIM) as sims:
        dying, healthy = sims
        dying.faults.die_after_chunks = DIES_AFTER
        instances = [{"url": dying.url}, {"url": healthy.url, "weight": 0.01}]
        async with (
            gateway_with(sims, instances=instances, sections=SECTIONS) as gw,
            aiohttp.ClientSession(headers=AUTH) as session,
        ):
            body = {
                "model": "sim-model",
                "prompt": "Once upon a time",
                "max_tokens": 30,
                "stream": True,
                "ignore_eos": True,
            }
            for _ in range(10):
                async with session.post(gw.base_url + "/completions", json=body) as resp:
                    first = resp.headers["X-Gateway-Instance"]
                    data = await resp.read()
                if first == instance_of(gw, dying):
                    break
            else:
                pytest.fail("no stream landed on the dying instance")
            text = await metrics_text(gw)
    events = [e for e in data.split(b"\n\n") if e.startswith(b"data: {")]
    ids = {re.search(rb'"id":"([^"]+)"', e).group(1) for e in events}  # type: ignore[union-attr]
    assert len(ids) == 1
    assert data.rstrip().endswith(b"data: [DONE]")
    assert b'"error"' not in data
    pieces = [e for e in events if re.search(rb'"text":"[^"]+"', e)]
    assert len(pieces) == 30
    assert b"usage" not in b"".join(events[-2:]).replace(b'"usage":null', b"")  # not asked
    assert migrations(text, "reset", "completed") >= 1


async def test_what_a_continuation_cannot_reproduce_ends_as_before() -> None:
    """A seeded stream (and every stream with migrations = 0) ends with the in-band error."""
    async with fleet(SIM, SIM) as sims:
        dying, healthy = sims
        dying.faults.die_after_chunks = DIES_AFTER
        instances = [{"url": dying.url}, {"url": healthy.url, "weight": 0.01}]
        async with (
            gateway_with(sims, instances=instances, sections=SECTIONS) as gw,
            aiohttp.ClientSession(headers=AUTH) as session,
        ):
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 30,
                "stream": True,
                "seed": 7,
            }
            for _ in range(10):
                async with session.post(gw.base_url + "/chat/completions", json=body) as resp:
                    first = resp.headers["X-Gateway-Instance"]
                    data = await resp.read()
                if first == instance_of(gw, dying):
                    break
            text = await metrics_text(gw)
    assert b'"error"' in data  # the in-band error event, as without migration
    assert b"the answer is incomplete" in data
    assert migrations(text, "seed", "refused") >= 1
    assert migrations(text, "reset", "completed") == 0


async def test_when_every_instance_breaks_the_stream_ends_with_the_in_band_error() -> None:
    async with fleet(SIM, SIM) as sims:
        for sim in sims:
            sim.faults.die_after_chunks = DIES_AFTER
        async with (
            gateway_with(sims, sections=SECTIONS) as gw,
            aiohttp.ClientSession(headers=AUTH) as session,
        ):
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40,
                "stream": True,
                "ignore_eos": True,
            }
            async with session.post(gw.base_url + "/chat/completions", json=body) as resp:
                data = await resp.read()
            text = await metrics_text(gw)
    assert b'"error"' in data
    assert migrations(text, "reset", "failed") == 1
    # Each part's text reached the client once: the first part's and the continuation's.
    pieces = re.findall(rb'"content":"([^"]+)"', data)
    assert len(pieces) >= 2 * (DIES_AFTER - 2)


async def test_a_messages_stream_is_not_migrated_and_the_anthropic_sdk_sees_its_error() -> None:
    """vLLM's /v1/messages starts a new assistant turn after a final assistant message (it
    builds its chat request without continue_final_message), so a continuation would not
    continue: the stream ends with Anthropic's error event, as before, counted refused."""
    async with fleet(SIM, SIM) as sims:
        dying, healthy = sims
        dying.faults.die_after_chunks = DIES_AFTER
        instances = [{"url": dying.url}, {"url": healthy.url, "weight": 0.01}]
        async with (
            gateway_with(sims, instances=instances, sections=SECTIONS) as gw,
            anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0) as client,
        ):
            for _ in range(10):
                text: list[str] = []
                error: anthropic.APIError | None = None
                try:
                    async with client.messages.stream(
                        model="sim-model",
                        max_tokens=40,
                        messages=[{"role": "user", "content": "a long story"}],
                    ) as stream:
                        async for piece in stream.text_stream:
                            text.append(piece)  # what came before the error
                except anthropic.APIError as exc:
                    error = exc
                if error is not None:
                    break
            else:
                pytest.fail("no stream landed on the dying instance")
            metrics = await metrics_text(gw)
    assert text  # part of the answer came before the error
    assert "the answer is incomplete" in str(error)
    assert migrations(metrics, "route", "refused") >= 1
