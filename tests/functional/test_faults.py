"""Each row of README's "Failure behaviour" table, provoked for real and checked end to end.

Instances are simulated vLLM servers behind `FaultProxy`s (tests/faultproxy.py), so a
test can refuse, reset, hang or cut a connection and then see, from the proxy's records,
when the gateway closed its side. Clients are the real OpenAI SDK with retries off.
Unless a test says otherwise the gateway dispatches round robin (the first request goes to
instance `a`), probes only once at start-up, and never ejects, so the fault under test is
the only thing that moves traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
from fakes import KEY, Gateway, fleet, gateway_with
from faultproxy import FaultProxy, eventually
from prometheus_client.parser import text_string_to_metric_families

from gateway.dispatch import Lane
from gateway.sim.sim_vllm import SimConfig

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
SLOW = SimConfig(decode_s_per_token=0.02, prefill_tokens_per_s=1e6, max_num_seqs=64)
INSTANT = SimConfig(instant=True)
NAMES = "abcdefgh"
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


QUIET: dict[str, Any] = {
    "dispatch": {
        "strategy": "round_robin",
        "health_check_interval": 60,
        "health": {"eject_after_failures": 1000},
    },
}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def proxied(
    *configs: SimConfig,
    sections: dict[str, Any] | None = None,
    channel: dict[str, Any] | None = None,
    instance_extra: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Gateway, list[FaultProxy]]]:
    """Simulated instances a, b, ... each behind a fault proxy, and a gateway in front."""
    async with fleet(*configs) as sims, contextlib.AsyncExitStack() as stack:
        proxies = [await stack.enter_async_context(FaultProxy(_port(s.url))) for s in sims]
        instances = [
            {"url": p.url, "name": name, **(instance_extra or {})}
            for p, name in zip(proxies, NAMES, strict=False)
        ]
        async with gateway_with(
            sims, instances=instances, sections=_merge(QUIET, sections or {}), channel=channel
        ) as gw:
            yield gw, proxies


def sdk(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)


async def scrape(gw: Gateway) -> Samples:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over samples whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def settled(gw: Gateway, timeout: float = 2.0) -> None:
    """Wait until /metrics shows nothing in flight and nothing queued, or fail."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        samples = await scrape(gw)
        busy = value(samples, "gateway_instance_inflight") + value(samples, "gateway_queue_depth")
        if busy == 0:
            return
        if loop.time() > deadline:
            raise AssertionError(f"gauges did not return to zero: {busy} busy; {gw.dispatcher!r}")
        await asyncio.sleep(0.02)


def closed_after(proxy: FaultProxy, since: float) -> list[float]:
    """Seconds after `since` at which connections through `proxy` were closed by the gateway."""
    return [
        c.client_closed_at - since
        for c in proxy.connections
        if c.client_closed_at is not None and c.client_closed_at >= since
    ]


async def stream_text(client: openai.AsyncOpenAI, messages: list[Any] = MESSAGES, **kw: Any) -> str:
    stream = await client.chat.completions.create(
        model="sim-model", messages=messages, stream=True, **kw
    )
    return await collect(stream, [])


async def collect(stream: openai.AsyncStream[Any], into: list[str]) -> str:
    """Read a chat stream to its end, appending each content delta to `into`."""
    async for chunk in stream:
        if chunk.choices:
            into.append(chunk.choices[0].delta.content or "")
    return "".join(into)


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
        await eventually(lambda: sched.queue_length(Lane.LONG) == 1, what="the second queued")
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
        assert value(samples, "gateway_queue_wait_seconds_count", lane=long_lane) == 1
        assert value(samples, "gateway_rejections_total") == 0
        assert value(samples, "gateway_requests_total", status="200") == 2
        await settled(gw)


async def test_all_instances_down_gives_503_fast_and_service_resumes() -> None:
    """All instances down: fast 503 with Retry-After, /readyz 503, then service resumes."""
    sections = {"dispatch": {"health_check_interval": 0.05}}
    async with proxied(FAST, FAST, sections=sections) as (gw, proxies), sdk(gw) as client:
        for proxy in proxies:
            await proxy.refuse()
        await eventually(lambda: not gw.dispatcher.scheduler.any_available(gw.dispatcher.clock()))
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
            await eventually(lambda: gw.dispatcher.scheduler.any_available(gw.dispatcher.clock()))
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


async def test_long_lane_stream_gets_long_ttft_factor_times_read() -> None:
    """A long-lane stream waits timeout.read x long_ttft_factor for a silent instance."""
    channel = {"timeout": {"connect": 2, "read": 0.3, "write": 5}}
    sections = {"prefill": {"long_input_threshold": 50, "long_ttft_factor": 4}}
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
    sections = {"prefill": {"long_input_threshold": 500, "long_ttft_factor": 5}}
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
    """An instance dying mid-stream gives the SDK the gateway's APIError; nothing is replayed."""
    async with proxied(SLOW, SLOW) as (gw, _), sdk(gw) as client:
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
    """On the wire, a broken stream's last two events are the error object and `data: [DONE]`."""
    async with proxied(SLOW, SLOW) as (gw, _), sdk(gw) as client:
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
    """A reset inside an SSE event still ends in the SDK's APIError, not a parse error."""
    async with proxied(SLOW, SLOW) as (gw, (a, _)), sdk(gw) as client:
        a.reset_after_bytes = 1000  # past the headers and first events, inside a later one
        with pytest.raises(openai.APIError) as info:
            await stream_text(client, max_tokens=50)
        assert not isinstance(info.value, openai.APIConnectionError)
        assert "broke the stream" in info.value.message
        assert sum(s.stats.requests for s in gw.sims) == 1


# ---------------------------------------------------------------- the client leaves


async def _leave_after(task: asyncio.Task[Any], ready: Callable[[], bool]) -> float:
    await eventually(ready, what="request in the expected phase")
    left = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return left


async def test_client_leaving_while_queued_frees_the_queue_and_never_reaches_an_instance() -> None:
    """A client that leaves while queued is dropped from the queue; gauges return to zero."""
    sections = {"dispatch": {"max_queue_per_instance": 0}}
    async with (
        proxied(SLOW, sections=sections, instance_extra={"max_num_seqs": 1}) as (gw, _),
        sdk(gw) as client,
    ):
        running = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True, max_tokens=200
        )
        queued = asyncio.create_task(stream_text(client, max_tokens=2))
        await _leave_after(queued, lambda: gw.dispatcher.scheduler.queue_length(_short()) == 1)
        assert value(await scrape(gw), "gateway_queue_depth") == 0
        await running.close()
        await settled(gw)
        assert gw.sims[0].stats.requests == 1


def _short() -> Any:
    from gateway.dispatch import Lane

    return Lane.SHORT


@pytest.mark.parametrize("phase", ["before_headers", "before_first_token"])
async def test_client_leaving_while_waiting_closes_the_upstream_connection(phase: str) -> None:
    """A client leaving before its first token closes the instance's connection within 1 s."""
    slow_prefill = SimConfig(prefill_tokens_per_s=100, decode_s_per_token=0.01)
    async with proxied(slow_prefill) as (gw, (a,)), sdk(gw) as client:
        sim = gw.sims[0]
        sim.faults.hang_before_headers = phase == "before_headers"
        task = asyncio.create_task(
            stream_text(client, max_tokens=5, messages=[{"role": "user", "content": "x" * 4000}])
        )
        in_phase = (
            (lambda: sim.stats.requests == 1)
            if phase == "before_headers"
            else (lambda: sim.stats.running == 1)
        )
        left = await _leave_after(task, in_phase)
        await eventually(lambda: bool(closed_after(a, left)), timeout=1.0)
        await eventually(lambda: sim.stats.cancelled == 1, timeout=1.0)
        await settled(gw, timeout=1.0)
        assert sim.stats.running == 0


async def test_client_leaving_mid_stream_closes_the_upstream_connection() -> None:
    """A client closing a started stream closes the instance's connection within 1 s."""
    async with proxied(SLOW) as (gw, (a,)), sdk(gw) as client:
        stream = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True, max_tokens=500
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        left = time.monotonic()
        await stream.close()
        await eventually(lambda: bool(closed_after(a, left)), timeout=1.0)
        await eventually(lambda: gw.sims[0].stats.cancelled == 1, timeout=1.0)
        await settled(gw, timeout=1.0)
        assert value(await scrape(gw), "gateway_stream_aborts_total", side="client") == 1


# ---------------------------------------------------------------- overload and retry storms


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


async def test_ten_times_capacity_is_bounded_and_admitted_requests_finish() -> None:
    """At 10x capacity: bounded queues, fast 429s, admitted requests finish, no leak."""
    slots, queue = 2, 4
    capacity = slots + queue
    sim = SimConfig(decode_s_per_token=0.01, prefill_tokens_per_s=1e6, max_num_seqs=slots)
    sections = {"dispatch": {"max_queue_per_instance": 0, "gateway_queue_size": queue}}
    async with (
        proxied(sim, sections=sections, instance_extra={"max_num_seqs": slots}) as (gw, _),
        sdk(gw) as client,
    ):
        scheduler = gw.dispatcher.scheduler
        peaks = {"inflight": 0, "queued": 0, "tasks": 0}
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                peaks["inflight"] = max(peaks["inflight"], scheduler.inflight)
                peaks["queued"] = max(peaks["queued"], scheduler.queue_length(_short()))
                peaks["tasks"] = max(peaks["tasks"], len(asyncio.all_tasks()))
                await asyncio.sleep(0.005)

        async def one() -> tuple[str, float]:
            started = time.monotonic()
            try:
                await client.chat.completions.create(
                    model="sim-model", messages=MESSAGES, max_tokens=10
                )
            except openai.RateLimitError as exc:
                overloaded = exc.code == "overloaded"
                retry_after = int(exc.response.headers.get("Retry-After", "0"))
                kind = "429" if overloaded and retry_after >= 1 else f"bad 429: {exc.body}"
                return kind, time.monotonic() - started
            return "ok", time.monotonic() - started

        async def wave() -> list[tuple[str, float]]:
            return await asyncio.gather(*(one() for _ in range(10 * capacity)))

        warm = await wave()  # warm-up: connection pools, caches, first-use allocations
        await settled(gw)
        gc.collect()
        tasks_before, rss_before = len(asyncio.all_tasks()), _rss_bytes()
        watcher = asyncio.create_task(watch())
        results = [r for _ in range(3) for r in await wave()]
        stop.set()
        await watcher
        await settled(gw)
        gc.collect()
        oks = [t for kind, t in results if kind == "ok"]
        rejected = [t for kind, t in results if kind == "429"]
        assert len(oks) + len(rejected) == len(results), {k for k, _ in results}
        assert len(oks) >= 3 * capacity
        assert rejected
        assert max(rejected) < 1.0
        assert peaks["inflight"] <= slots
        assert peaks["queued"] <= queue
        assert gw.sims[0].stats.completed == len(oks) + sum(kind == "ok" for kind, _ in warm)
        assert peaks["tasks"] < tasks_before + 4 * 10 * capacity
        assert len(asyncio.all_tasks()) <= tasks_before + 1
        assert _rss_bytes() - rss_before < 20 * 2**20


async def test_retry_storm_stays_within_the_retry_budget() -> None:
    """With half the fleet answering 502, upstream attempts stay within the retry budget."""
    requests = 120
    async with proxied(INSTANT, INSTANT, INSTANT, INSTANT) as (gw, _), sdk(gw) as client:
        for sim in gw.sims[:2]:
            sim.faults.status = 502
        sem = asyncio.Semaphore(8)

        async def one() -> int:
            async with sem:
                try:
                    await client.chat.completions.create(
                        model="sim-model", messages=MESSAGES, max_tokens=2
                    )
                    return 200
                except openai.APIStatusError as exc:
                    return exc.status_code

        started = time.monotonic()
        statuses = await asyncio.gather(*(one() for _ in range(requests)))
        assert time.monotonic() - started < 9, "the budget's 10 s window must hold the whole storm"
        attempts = sum(s.stats.requests for s in gw.sims)
        budget = max(10, int(0.2 * requests))
        assert attempts <= requests + budget, (attempts, requests, budget)
        assert set(statuses) <= {200, 502}
        samples = await scrape(gw)
        assert value(samples, "gateway_retries_refused_total", why="budget") > 0
        assert value(samples, "gateway_retries_total") == attempts - requests


# ---------------------------------------------------------------- the fault proxy itself


@contextlib.asynccontextmanager
async def _echo_server() -> AsyncIterator[int]:
    """An upstream that answers each chunk it reads with that chunk repeated 100 times."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1024):
                writer.write(data * 100)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def _exchange(proxy: FaultProxy, payload: bytes, want: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(payload)
        await writer.drain()
        return await reader.readexactly(want)
    finally:
        writer.close()


async def test_fault_proxy_forwards_and_adds_latency_and_trickles() -> None:
    """The proxy forwards both ways, adds latency per direction and throttles to a byte rate."""
    async with _echo_server() as port, FaultProxy(port) as proxy:
        assert await _exchange(proxy, b"ab", 200) == b"ab" * 100
        proxy.latency_up = proxy.latency_down = 0.15
        started = time.monotonic()
        await _exchange(proxy, b"ab", 200)
        assert time.monotonic() - started >= 0.3
        proxy.latency_up = proxy.latency_down = 0.0
        proxy.trickle_bytes_per_s = 1000
        started = time.monotonic()
        await _exchange(proxy, b"abcd", 400)  # 400 bytes at 1000 B/s: 7 ticks of 50 ms
        assert time.monotonic() - started >= 0.3
        await eventually(lambda: len(proxy.open_connections()) == 0, timeout=1.0)
        assert proxy.seen == 3
        assert all(c.client_closed_at is not None for c in proxy.connections)


async def test_fault_proxy_resets_refuses_and_restores() -> None:
    """The proxy resets after N answer bytes, refuses while down, and serves again once restored."""
    async with _echo_server() as port, FaultProxy(port) as proxy:
        proxy.reset_after_bytes = 50
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)) as info:
            await _exchange(proxy, b"ab", 200)
        if isinstance(info.value, asyncio.IncompleteReadError):
            assert len(info.value.partial) <= 50
        assert proxy.connections[-1].reset
        proxy.reset_after_bytes = None
        await proxy.refuse()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", proxy.port)
        await proxy.restore()
        assert await _exchange(proxy, b"z", 100) == b"z" * 100
        proxy.hang = True
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await _exchange(proxy, b"q", 100)
        await eventually(lambda: proxy.connections[-1].client_closed_at is not None, timeout=1.0)
        assert proxy.connections[-1].hung
