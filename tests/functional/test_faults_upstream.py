"""README's "Failure behaviour" rows for a failing instance, provoked for real and checked end
to end: refused or reset before the answer, hung before headers, cut after the answer started.

The set-up (simulated instances behind fault proxies, round robin, no ejection) is described
in _fault_helpers.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest
from _fault_helpers import (
    MESSAGES,
    SLOW,
    closed_after,
    collect,
    proxied,
    scrape,
    sdk,
    settled,
    stream_text,
    value,
)
from faultproxy import eventually

from gateway.dispatch import Lane
from gateway.sim.sim_vllm import SimConfig

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)

# The in-band error's path, as a stream that cannot be continued elsewhere takes it.
NO_MIGRATION = {
    "retry": {"max_attempts": 3, "backoff_base": 0.01, "backoff_max": 0.05, "migrations": 0}
}


async def served_by(client: openai.AsyncOpenAI, stream: bool, **kw: Any) -> str:
    """Send one chat (streamed or not) and return the X-Gateway-Instance that served it."""
    if stream:
        async with client.chat.completions.with_streaming_response.create(
            model="sim-model", messages=MESSAGES, stream=True, max_tokens=3, **kw
        ) as resp:
            lines = [line async for line in resp.iter_lines()]
            assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines
            return str(resp.headers["X-Gateway-Instance"])
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-model", messages=MESSAGES, max_tokens=3, **kw
    )
    assert raw.parse().choices[0].message.content
    return str(raw.headers["X-Gateway-Instance"])


# ---------------------------------------------------------------- before the answer starts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_refused_connection_is_served_by_another_instance(stream: bool) -> None:
    """A refused connection is retried on another instance and the SDK sees success."""
    async with proxied(FAST, FAST) as (gw, (a, _)), sdk(gw) as client:
        await a.refuse()
        assert await served_by(client, stream) == "b"
        samples = await scrape(gw)
        assert value(samples, "gateway_retries_total", reason="connect") == 1
        assert value(samples, "gateway_instance_errors_total", server="a", kind="connect") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_reset_before_headers_is_served_by_another_instance(stream: bool) -> None:
    """An instance that resets the connection before any answer byte is retried elsewhere."""
    async with proxied(FAST, FAST) as (gw, (a, _)), sdk(gw) as client:
        a.reset_after_bytes = 0
        assert await served_by(client, stream) == "b"
        assert any(c.reset for c in a.connections)
        assert value(await scrape(gw), "gateway_retries_total") == 1


async def test_refused_long_request_waits_for_room_on_another_instance() -> None:
    """A long request refused by `a` waits in the gateway (it does not fail, nor crowd b's
    single long-prefill place) until b's first long request has its first token, not its
    last; then b serves it, after one refused attempt on a."""
    slow_prefill = SimConfig(prefill_tokens_per_s=1000, decode_s_per_token=0.001)
    sections = {
        "gateway": {"request_timeout": 20},
        "prefill": {"long_input_threshold": 100, "max_long_per_instance": 1},
    }
    long_prompt = [{"role": "user", "content": "word" * 1000}]  # 1000 tokens: 1 s of prefill

    async def long_stream(max_tokens: int) -> tuple[str, list[str]]:
        async with client.chat.completions.with_streaming_response.create(
            model="sim-model", messages=long_prompt, stream=True, max_tokens=max_tokens
        ) as resp:
            lines = [line async for line in resp.iter_lines() if line]
            return resp.headers["X-Gateway-Instance"], lines

    async with (
        proxied(slow_prefill, slow_prefill, sections=sections) as (gw, (a, _)),
        sdk(gw) as client,
    ):
        sched, b = gw.dispatcher.scheduler, gw.sims[1]
        await a.refuse()
        # Round robin sends each request to a first: a refuses it, and the retry goes to b.
        holder = asyncio.create_task(long_stream(1000))  # 1 s of prefill, 1 s of decode
        await eventually(lambda: b.stats.running == 1, what="the first long request on b")
        waiter = asyncio.create_task(long_stream(2))
        await eventually(
            lambda: gw.dispatcher.snapshot().queues[Lane.LONG] == 1, what="the second queued"
        )
        # b is still prefilling the first: the second waits in the gateway, not on b.
        assert sched.state("b").long_prefilling == 1
        assert b.stats.requests == 1
        assert not waiter.done()
        # The first token frees the place: b gets the second while the first still decodes.
        await eventually(lambda: b.stats.requests == 2, what="the second sent to b")
        assert b.stats.completed == 0
        for task in (holder, waiter):
            instance, lines = await task
            assert instance == "b"
            assert lines[-1] == "data: [DONE]"
            assert not any('"error"' in line for line in lines)
        assert (b.stats.requests, b.stats.completed) == (2, 2)
        samples = await scrape(gw)
        assert value(samples, "gateway_instance_errors_total", server="a", kind="connect") == 2
        assert value(samples, "gateway_instance_requests_total", server="b", status="200") == 2
        assert value(samples, "gateway_retries_total") == 2
        long_lane = gw.metrics.lane_names[Lane.LONG]
        # Every placement is observed: the two refused on a and the first's retry at once
        # (0 s), the second's retry after its wait.
        assert value(samples, "gateway_queue_wait_seconds_count", lane=long_lane) == 4
        assert value(samples, "gateway_rejections_total") == 0
        assert value(samples, "gateway_requests_total", status="200") == 2
        await settled(gw)


async def test_all_instances_down_gives_503_fast_and_service_resumes() -> None:
    """All instances down: fast 503 with Retry-After, /readyz 503, then service resumes."""
    sections = {"dispatch": {"health_check_interval": 0.05}}
    async with proxied(FAST, FAST, sections=sections) as (gw, proxies), sdk(gw) as client:
        for proxy in proxies:
            await proxy.refuse()
        await eventually(lambda: not gw.dispatcher.snapshot().up())
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="sim-model", messages=MESSAGES)
        assert time.monotonic() - started < 0.5
        assert info.value.status_code == 503
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert info.value.code == "no_instance_available"
        async with aiohttp.ClientSession() as s:
            assert (await s.get(gw.url + "/readyz")).status == 503
            await proxies[1].restore()
            await eventually(lambda: gw.dispatcher.snapshot().up())
            assert (await s.get(gw.url + "/readyz")).status == 200
        assert await served_by(client, stream=True) == "b"


async def test_every_instance_refusing_before_health_notices_gives_503_with_retry_after() -> None:
    """Every instance refusing before probes notice still gives 503 with Retry-After."""
    async with proxied(FAST, FAST) as (gw, proxies), sdk(gw) as client:
        for proxy in proxies:
            await proxy.refuse()
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="sim-model", messages=MESSAGES)
        assert time.monotonic() - started < 1.0
        assert info.value.status_code == 503
        assert int(info.value.response.headers["Retry-After"]) >= 1


# ---------------------------------------------------------------- hang before headers


async def test_hung_instance_times_out_per_attempt_and_a_stream_is_retried_elsewhere() -> None:
    """A silent instance's attempt ends after timeout.read with its connection closed; b serves."""
    channel = {"timeout": {"connect": 2, "read": 0.5, "write": 5}}
    async with proxied(FAST, FAST, channel=channel) as (gw, (a, _)), sdk(gw) as client:
        a.hang = True
        started = time.monotonic()
        assert await stream_text(client, max_tokens=3)
        assert 0.45 < time.monotonic() - started < 3.0
        hung = [c for c in a.connections if c.hung]
        assert len(hung) == 1
        assert hung[0].client_closed_at is not None
        assert 0.45 < hung[0].client_closed_at - started < 1.5
        assert value(await scrape(gw), "gateway_retries_total", reason="timeout") == 1
        assert gw.sims[1].stats.requests == 1


async def test_long_lane_stream_gets_four_times_read() -> None:
    """A long-lane stream waits timeout.read x LONG_TTFT_FACTOR (4) for a silent instance."""
    channel = {"timeout": {"connect": 2, "read": 0.3, "write": 5}}
    sections = {"prefill": {"long_input_threshold": 50}}
    async with (
        proxied(FAST, FAST, channel=channel, sections=sections) as (gw, (a, _)),
        sdk(gw) as client,
    ):
        a.hang = True
        started = time.monotonic()
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "word " * 200}],
            stream=True,
            max_tokens=2,
        )
        assert [c async for c in stream]
        closes = [
            c.client_closed_at - started for c in a.connections if c.hung and c.client_closed_at
        ]
        assert len(closes) == 1
        assert 1.1 < closes[0] < 2.5, closes


async def test_long_prefill_slower_than_read_streams_on_the_first_attempt() -> None:
    """A long prompt whose first token comes after timeout.read, within the allowance, streams."""
    channel = {"timeout": {"connect": 2, "read": 0.3, "write": 5}}
    sections = {"prefill": {"long_input_threshold": 500}}
    # 1500 prompt tokens at 2000 tokens/s: the first token after about 0.75 s.
    slow_prefill = SimConfig(prefill_tokens_per_s=2000, decode_s_per_token=0.001)
    async with (
        proxied(slow_prefill, slow_prefill, channel=channel, sections=sections) as (gw, _),
        sdk(gw) as client,
    ):
        text = await stream_text(
            client, messages=[{"role": "user", "content": "word" * 1500}], max_tokens=3
        )
        assert text
        assert sum(s.stats.requests for s in gw.sims) == 1


async def test_hung_whole_answer_is_bounded_by_request_timeout_then_504() -> None:
    """A whole answer from a silent instance gets 504 at request_timeout; the connection closes."""
    sections = {"gateway": {"request_timeout": 1.5}}
    async with proxied(FAST, FAST, sections=sections) as (gw, (a, _)), sdk(gw) as client:
        a.hang = True
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="sim-model", messages=MESSAGES)
        elapsed = time.monotonic() - started
        assert info.value.status_code == 504
        assert info.value.code == "upstream_timeout"
        assert 1.4 < elapsed < 3.0
        await eventually(lambda: bool(closed_after(a, started)), timeout=1.0)


async def test_stream_whose_deadline_leaves_no_room_gets_504() -> None:
    """After a timed-out attempt, the retry gets only what is left of the deadline, then 504."""
    channel = {"timeout": {"connect": 2, "read": 0.5, "write": 5}}
    sections = {"gateway": {"request_timeout": 0.8}}
    async with (
        proxied(FAST, FAST, channel=channel, sections=sections) as (gw, proxies),
        sdk(gw) as client,
    ):
        for proxy in proxies:
            proxy.hang = True
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            await stream_text(client, max_tokens=3)
        assert info.value.status_code == 504
        assert 0.7 < time.monotonic() - started < 2.0
        for proxy in proxies:
            await eventually(lambda p=proxy: bool(closed_after(p, started)), timeout=1.0)  # type: ignore[misc]


async def test_timed_out_request_is_not_sent_back_to_an_instance_that_hung() -> None:
    """A request is never sent again to an instance where it already timed out."""
    channel = {"timeout": {"connect": 2, "read": 0.3, "write": 5}}
    sections = {"gateway": {"request_timeout": 10}}
    async with (
        proxied(FAST, FAST, channel=channel, sections=sections) as (gw, proxies),
        sdk(gw) as client,
    ):
        for proxy in proxies:
            proxy.hang = True
        with pytest.raises(openai.InternalServerError) as info:
            await stream_text(client, max_tokens=3)
        assert info.value.status_code == 504
        assert [sum(c.hung for c in p.connections) for p in proxies] == [1, 1]


async def test_whole_answer_slower_than_read_timeout_succeeds_within_request_timeout() -> None:
    """A whole answer slower than timeout.read but within request_timeout arrives."""
    channel = {"timeout": {"connect": 2, "read": 0.3, "write": 5}}
    sections = {"gateway": {"request_timeout": 10}}
    slow = SimConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1e6)
    async with proxied(slow, slow, channel=channel, sections=sections) as (gw, _), sdk(gw) as c:
        answer = await c.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=20
        )
        assert answer.usage is not None
        assert answer.usage.completion_tokens == 20
        assert sum(s.stats.requests for s in gw.sims) == 1


# ---------------------------------------------------------------- after the answer started


async def test_instance_dying_mid_stream_gives_an_in_band_error_and_no_replay() -> None:
    """With migration off, an instance dying mid-stream gives the SDK the gateway's APIError;
    nothing is replayed (test_migration.py has the stream going on elsewhere)."""
    async with proxied(SLOW, SLOW, channel=NO_MIGRATION) as (gw, _), sdk(gw) as client:
        gw.sims[0].faults.die_after_chunks = 4
        stream = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True, max_tokens=50
        )
        received: list[str] = []
        with pytest.raises(openai.APIError) as info:
            await collect(stream, received)
        assert not isinstance(info.value, openai.APIConnectionError)
        assert "broke the stream" in info.value.message
        assert 1 <= len(received) <= 4
        assert sum(s.stats.requests for s in gw.sims) == 1
        samples = await scrape(gw)
        assert value(samples, "gateway_stream_aborts_total", side="upstream") == 1
        assert value(samples, "gateway_retries_total") == 0


async def test_mid_stream_death_ends_with_error_event_then_done_on_the_wire() -> None:
    """On the wire, a broken stream not migrated ends with the error object and `data: [DONE]`."""
    async with proxied(SLOW, SLOW, channel=NO_MIGRATION) as (gw, _), sdk(gw) as client:
        gw.sims[0].faults.die_after_chunks = 3
        async with client.chat.completions.with_streaming_response.create(
            model="sim-model", messages=MESSAGES, stream=True, max_tokens=50
        ) as resp:
            events = [line async for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith('data: {"error": ')
    assert "broke the stream" in events[-2]
    assert len(events) == 3 + 2


async def test_reset_in_the_middle_of_an_event_still_gives_an_in_band_api_error() -> None:
    """A reset inside an SSE event, not migrated, ends in the SDK's APIError, not a parse
    error."""
    async with proxied(SLOW, SLOW, channel=NO_MIGRATION) as (gw, (a, _)), sdk(gw) as client:
        a.reset_after_bytes = 1000  # past the headers and first events, inside a later one
        with pytest.raises(openai.APIError) as info:
            await stream_text(client, max_tokens=50)
        assert not isinstance(info.value, openai.APIConnectionError)
        assert "broke the stream" in info.value.message
        assert sum(s.stats.requests for s in gw.sims) == 1
