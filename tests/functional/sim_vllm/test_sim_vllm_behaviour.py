"""How the simulated vLLM behaves, against a real server on 127.0.0.1: its timing model and
metrics under load, auth, injected faults, stop and restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from _sim_helpers import CHAT_URL, MakeSim, chat_body, client_for
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import BUSY_MESSAGE, SimInstance


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
