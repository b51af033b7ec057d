"""Functional tests of the simulated vLLM instance, against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.fleet import main as fleet_main
from gateway.sim.fleet import start_fleet, stop_fleet
from gateway.sim.sim_engine import ApiError, parse_stream
from gateway.sim.sim_vllm import (
    BUSY_MESSAGE,
    SimConfig,
    SimInstance,
    count_message_tokens,
    count_tokens,
)

MakeSim = Callable[..., Awaitable[SimInstance]]
CHAT_URL = "/v1/chat/completions"


@pytest.fixture
async def make_sim() -> AsyncIterator[MakeSim]:
    """Factory starting simulators with SimConfig keyword overrides; stops them all afterwards."""
    instances: list[SimInstance] = []

    async def make(**overrides: Any) -> SimInstance:
        instance = SimInstance(SimConfig(**overrides))
        await instance.start()
        instances.append(instance)
        return instance

    yield make
    for instance in instances:
        await instance.stop()


@pytest.fixture
async def sim(make_sim: MakeSim) -> SimInstance:
    """A simulator with the default configuration."""
    return await make_sim()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp client session."""
    async with aiohttp.ClientSession() as session:
        yield session


def client_for(sim: SimInstance, **kwargs: Any) -> openai.AsyncOpenAI:
    """An OpenAI client pointed at the simulator, without retries so faults surface at once."""
    kwargs.setdefault("api_key", sim.config.api_key or "unused")
    kwargs.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=sim.url + "/v1", **kwargs)


def chat_body(max_tokens: int = 5, content: str = "hello there", **extra: Any) -> dict[str, Any]:
    """A chat request body for the simulator's default model."""
    messages = [{"role": "user", "content": content}]
    return {"model": "sim-model", "messages": messages, "max_tokens": max_tokens, **extra}


async def eventually(predicate: Callable[[], bool], timeout: float = 1.0) -> None:
    """Wait until predicate() holds, failing after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def scrape(
    http: aiohttp.ClientSession, sim: SimInstance
) -> dict[str, tuple[dict[str, str], float]]:
    """Metric samples by name from /metrics, with their labels."""
    async with http.get(sim.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        sample.name: (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


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


# --- timing model ----------------------------------------------------------------------------


async def test_continuous_batching_queues_beyond_slots(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """With 2 slots, 2 of 4 concurrent requests run and 2 wait, then all complete."""
    sim = await make_sim(max_num_seqs=2)

    async def one() -> None:
        async with http.post(sim.url + CHAT_URL, json=chat_body(max_tokens=20)) as resp:
            assert resp.status == 200
            await resp.read()

    tasks = [asyncio.create_task(one()) for _ in range(4)]
    await eventually(lambda: sim.stats.requests == 4)
    assert (sim.stats.running, sim.stats.waiting) == (2, 2)
    await eventually(lambda: sim.stats.waiting == 0, timeout=2.0)
    assert sim.stats.running == 2
    await asyncio.gather(*tasks)
    assert (sim.stats.running, sim.stats.waiting, sim.stats.completed) == (0, 0, 4)


async def test_slow_card_takes_twice_as_long(make_sim: MakeSim) -> None:
    """At speed 0.5 the same request takes about twice as long as at speed 1."""
    fast, slow = await make_sim(speed=1.0), await make_sim(speed=0.5)

    async def timed(client: openai.AsyncOpenAI) -> float:
        started = time.monotonic()
        await client.completions.create(model="sim-model", prompt="x" * 4000, max_tokens=25)
        return time.monotonic() - started

    # Clients are built beforehand: building one blocks the loop and would skew the timing.
    async with client_for(fast) as fast_client, client_for(slow) as slow_client:
        fast_s, slow_s = await asyncio.gather(timed(fast_client), timed(slow_client))
    assert 0.2 < fast_s < 0.8
    assert 1.5 < slow_s / fast_s < 2.6


async def test_set_speed_mid_run(sim: SimInstance) -> None:
    """set_speed changes the pace of a request already decoding."""
    async with client_for(sim) as client:
        stream = await client.completions.create(
            model="sim-model", prompt="x", max_tokens=40, stream=True
        )
        await anext(aiter(stream))
        sim.set_speed(10.0)
        started = time.monotonic()
        rest = [chunk async for chunk in stream]
    assert len(rest) == 39
    assert time.monotonic() - started < 0.2
    assert sim.config.speed == 10.0


async def test_metrics_while_running(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """/metrics exposes vLLM's gauges with model_name and engine labels and live values."""
    sim = await make_sim(max_num_seqs=2, model="m1")
    prompt = "y" * 1600  # 400 tokens each

    async def one() -> None:
        body = {"model": "m1", "prompt": prompt, "max_tokens": 30}
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()

    tasks = [asyncio.create_task(one()) for _ in range(3)]
    await eventually(lambda: sim.stats.requests == 3 and sim.stats.generation_tokens > 0)
    samples = await scrape(http, sim)
    labels = {"model_name": "m1", "engine": "0"}
    assert samples["vllm:num_requests_running"] == (labels, 2.0)
    assert samples["vllm:num_requests_waiting"] == (labels, 1.0)
    kv_labels, kv = samples["vllm:kv_cache_usage_perc"]
    assert kv_labels == labels
    assert 800 / 4096 < kv < 870 / 4096
    await asyncio.gather(*tasks)
    samples = await scrape(http, sim)
    assert samples["vllm:num_requests_running"][1] == 0.0
    assert samples["vllm:kv_cache_usage_perc"][1] == 0.0
    assert samples["vllm:prompt_tokens_total"][1] == 1200.0
    assert samples["vllm:generation_tokens_total"][1] == 90.0
    success_labels, success = samples["vllm:request_success_total"]
    assert success == 3.0
    assert success_labels["model_name"] == "m1"


async def test_waiting_queue_limit_answers_busy(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """Beyond max_waiting queued requests the instance answers vLLM's 503 busy error."""
    sim = await make_sim(max_num_seqs=1, max_waiting=1)

    async def one() -> int:
        async with http.post(sim.url + CHAT_URL, json=chat_body(max_tokens=10)) as resp:
            await resp.read()
            return resp.status

    first = asyncio.create_task(one())
    second = asyncio.create_task(one())
    await eventually(lambda: sim.stats.waiting == 1)
    assert await one() == 503
    assert sorted(await asyncio.gather(first, second)) == [200, 200]
    assert sim.stats.rejected == 1


# --- auth and faults -------------------------------------------------------------------------


async def test_auth_guards_v1_only(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """A wrong key gets vLLM's 401 body on /v1; /health and /metrics stay open."""
    sim = await make_sim(api_key="secret")
    async with client_for(sim, api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.models.list()
    assert caught.value.status_code == 401
    assert caught.value.response.json() == {"error": "Unauthorized"}
    async with client_for(sim) as client:
        assert [m.id async for m in client.models.list()] == ["sim-model"]
    for path in ("/health", "/metrics"):
        async with http.get(sim.url + path) as resp:
            assert resp.status == 200, path
    assert sim.stats.last_headers["authorization"] == "Bearer secret"


async def test_fault_status_and_busy(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """Fault switches answer a chosen status or vLLM's exact 503 busy body."""
    sim.faults.status = 500
    async with client_for(sim) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}]
            )
    error = caught.value.response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("InternalServerError", 500, None)
    sim.faults.status = None
    sim.faults.busy = True
    async with http.post(sim.url + CHAT_URL, json=chat_body()) as resp:
        assert resp.status == 503
        assert await resp.json() == {
            "error": {
                "message": BUSY_MESSAGE,
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
        }
    sim.faults.busy = False
    sim.faults.health_status = 503
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503
    assert (sim.stats.rejected, sim.stats.completed) == (2, 0)


async def test_die_after_chunks_drops_connection(sim: SimInstance) -> None:
    """die_after_chunks=2 sends two events, then the client sees the connection drop."""
    sim.faults.die_after_chunks = 2
    received: list[Any] = []
    async with client_for(sim) as client:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            stream=True,
        )

        async def consume() -> None:
            async for chunk in stream:
                received.append(chunk)

        with pytest.raises(openai.APIConnectionError):
            await consume()
    assert len(received) == 2
    await eventually(lambda: sim.stats.rejected == 1)
    assert (sim.stats.running, sim.stats.completed, sim.stats.cancelled) == (0, 0, 0)


async def test_hang_before_headers_times_out(sim: SimInstance) -> None:
    """A hung request times the client out and counts as cancelled once the client leaves."""
    sim.faults.hang_before_headers = True
    async with client_for(sim, timeout=0.3) as client:
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}]
            )
    await eventually(lambda: sim.stats.cancelled == 1)


async def test_client_disconnect_mid_stream(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """A client leaving mid-stream is dropped from the engine within a second."""
    body = chat_body(max_tokens=200, stream=True)
    resp = await http.post(sim.url + CHAT_URL, json=body)
    events = 0
    async for line in resp.content:
        events += line.startswith(b"data: ")
        if events == 3:
            break
    assert sim.stats.running == 1
    resp.close()
    await eventually(lambda: sim.stats.cancelled == 1)
    assert (sim.stats.running, sim.stats.completed) == (0, 0)


async def test_stop_cuts_open_requests(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """stop() ends at once, cutting a running stream and a hung request like a dead server."""
    resp = await http.post(sim.url + CHAT_URL, json=chat_body(max_tokens=500, stream=True))
    await resp.content.readline()
    sim.faults.hang_before_headers = True
    hung = asyncio.create_task(http.post(sim.url + CHAT_URL, json=chat_body()))
    await eventually(lambda: sim.stats.requests == 2)
    started = time.monotonic()
    await sim.stop()
    assert time.monotonic() - started < 0.5
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    resp.release()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await hung
    assert (sim.stats.running, sim.stats.waiting, sim.stats.cancelled) == (0, 0, 2)


async def test_restart_on_same_port(sim: SimInstance, http: aiohttp.ClientSession) -> None:
    """A stopped instance refuses connections, and can start again on the same port."""
    url = sim.url
    await sim.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.get(url + "/health")
    assert await sim.start(port=int(url.rsplit(":", 1)[1])) == url
    async with http.post(url + CHAT_URL, json=chat_body(max_tokens=2)) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 2


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
