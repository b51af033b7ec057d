"""Dispatch end to end: shares, overflow, queueing, health, retries, cancellation."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

SLOW_DECODE = SimConfig(decode_s_per_token=0.02, prefill_tokens_per_s=1e6, max_num_seqs=64)


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)


async def chat(gw: Gateway, max_tokens: int = 4, content: str = "hi", **kw: object) -> str:
    """One non-streamed chat; returns the instance that served it."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                **kw,
            },
            headers={"Authorization": f"Bearer {KEY}"},
        )
        await resp.read()
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Gateway-Instance"]


async def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def metric(gw: Gateway, name: str, **labels: str) -> float | None:
    """The sum of `name` over the series whose labels include `labels` (None if none)."""
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(gw.url + "/metrics")).text()
    values = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            values.append(float(line.rsplit(" ", 1)[1]))
    return sum(values) if values else None


async def slow_card_share(strategy: str) -> float:
    fast = SimConfig(decode_s_per_token=0.004, prefill_tokens_per_s=1e6, max_num_seqs=4)
    slow = SimConfig(decode_s_per_token=0.004, prefill_tokens_per_s=1e6, max_num_seqs=4, speed=0.25)
    async with (
        fleet(fast, fast, slow) as sims,
        gateway_with(
            sims,
            sections={"dispatch": {"strategy": strategy, "max_queue_per_instance": 64}},
        ) as gw,
    ):
        sem = asyncio.Semaphore(9)

        async def one() -> str:
            async with sem:
                return await chat(gw, max_tokens=10)

        served = await asyncio.gather(*(one() for _ in range(60)))
        return served.count(gw.names()[2]) / len(served)


async def test_slow_card_gets_a_smaller_share_under_least_busy() -> None:
    """A card at 25% speed gets clearly less work under least_busy than under round_robin."""
    round_robin = await slow_card_share("round_robin")
    least_busy = await slow_card_share("least_busy")
    assert round_robin == pytest.approx(1 / 3, abs=0.02)
    assert least_busy < round_robin * 0.8


async def test_full_instance_overflows_to_another() -> None:
    """An instance at slots + max_queue_per_instance sends the next request elsewhere."""
    async with fleet(SLOW_DECODE, SLOW_DECODE) as sims:
        instances = [{"url": sims[0].url, "max_num_seqs": 1}, {"url": sims[1].url}]
        async with gateway_with(
            sims,
            instances=instances,
            sections={"dispatch": {"strategy": "round_robin", "max_queue_per_instance": 0}},
        ) as gw:
            served = await asyncio.gather(*(chat(gw, max_tokens=10) for _ in range(4)))
    assert served.count(gw.names()[0]) == 1
    assert served.count(gw.names()[1]) == 3


async def test_full_fleet_queues_then_answers_429_with_retry_after() -> None:
    """With every instance full and the gateway queue full, the next request gets 429."""
    async with (
        fleet(SLOW_DECODE) as sims,
        gateway_with(
            sims,
            instances=[{"url": sims[0].url, "max_num_seqs": 1}],
            sections={"dispatch": {"max_queue_per_instance": 0, "gateway_queue_size": 1}},
        ) as gw,
    ):
        running = asyncio.create_task(chat(gw, max_tokens=15))
        await eventually(lambda: gw.dispatcher.snapshot().inflight == 1)
        queued = asyncio.create_task(chat(gw, max_tokens=1))
        await eventually(lambda: gw.dispatcher.snapshot().queues[_short()] == 1)
        async with client(gw) as c:
            with pytest.raises(openai.RateLimitError) as info:
                await c.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "x"}]
                )
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert info.value.code == "overloaded"
        # The queued one is served once the running one finishes, on the same instance.
        assert await queued == await running


def _short() -> object:
    from gateway.dispatch import Lane

    return Lane.SHORT


async def test_queue_depth_metric_shows_requests_waiting_at_an_instance() -> None:
    """gateway_instance_queue_depth shows requests waiting beyond an instance's slots."""
    sim_config = SimConfig(decode_s_per_token=0.02, prefill_tokens_per_s=1e6, max_num_seqs=2)
    async with (
        fleet(sim_config) as sims,
        gateway_with(
            sims,
            instances=[{"url": sims[0].url, "max_num_seqs": 2, "name": "card0"}],
            sections={"dispatch": {"health_check_interval": 0.1}},
        ) as gw,
    ):
        tasks = [asyncio.create_task(chat(gw, max_tokens=20)) for _ in range(5)]
        await eventually(lambda: gw.dispatcher.snapshot().inflight == 5)
        assert await metric(gw, "gateway_instance_queue_depth", server="card0") == 3.0
        assert await metric(gw, "gateway_instance_inflight", server="card0") == 5.0
        await asyncio.gather(*tasks)
        assert await metric(gw, "gateway_instance_queue_depth", server="card0") == 0.0


async def test_killed_instance_loses_traffic_and_regains_it_after_return() -> None:
    """A stopped instance is marked down after `fall` probes and back up after `rise`."""
    fast = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
    async with (
        fleet(fast, fast) as sims,
        gateway_with(sims, sections={"dispatch": {"health_check_interval": 0.05}}) as gw,
    ):
        b = gw.names()[1]
        port = int(sims[1].url.rsplit(":", 1)[1])
        await sims[1].stop()
        await eventually(
            lambda: not gw.dispatcher.scheduler.state(b).available(gw.dispatcher.clock())
        )
        served = [await chat(gw) for _ in range(10)]
        assert b not in served
        await sims[1].start(port=port)
        await eventually(lambda: gw.dispatcher.scheduler.state(b).up is True)
        served = set(await asyncio.gather(*(chat(gw, max_tokens=3) for _ in range(20))))
        assert b in served


async def test_busy_instance_is_retried_on_another() -> None:
    """vLLM's 503 engine-busy is retried on another instance; the client sees success."""
    fast = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
    async with (
        fleet(fast, fast) as sims,
        gateway_with(sims, sections={"dispatch": {"strategy": "round_robin"}}) as gw,
    ):
        sims[0].faults.busy = True
        served = [await chat(gw) for _ in range(4)]
        assert set(served) == {gw.names()[1]}
        assert sims[0].stats.requests >= 1
        assert (await metric(gw, "gateway_retries_total", reason="status_503") or 0) >= 1


async def test_client_errors_are_not_retried() -> None:
    """A 4xx from the instance is passed through untouched and never retried."""
    fast = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
    async with fleet(fast, fast) as sims, gateway_with(sims) as gw:
        async with client(gw) as c:
            with pytest.raises(openai.BadRequestError):
                await c.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=-1
                )
        assert sum(s.stats.requests for s in sims) == 1


async def test_all_instances_down_gives_503_with_retry_after_fast() -> None:
    """With no instance up the gateway answers 503 with Retry-After at once; /readyz is 503."""
    fast = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
    async with (
        fleet(fast) as sims,
        gateway_with(sims, sections={"dispatch": {"health_check_interval": 0.05}}) as gw,
    ):
        await sims[0].stop()
        await eventually(lambda: not gw.dispatcher.snapshot().up())
        async with aiohttp.ClientSession() as s:
            started = asyncio.get_running_loop().time()
            resp = await s.post(
                gw.url + "/v1/completions",
                json={"prompt": "x"},
                headers={"Authorization": f"Bearer {KEY}"},
            )
            elapsed = asyncio.get_running_loop().time() - started
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_instance_available"
            assert elapsed < 0.5
            assert (await s.get(gw.url + "/readyz")).status == 503


async def test_long_prompts_take_the_long_lane_instances() -> None:
    """Prompts above the threshold go to the long-lane instance, short ones to the short one."""
    fast = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
    async with fleet(fast, fast) as sims:
        instances = [
            {"url": sims[0].url, "lane": "short", "name": "short0"},
            {"url": sims[1].url, "lane": "long", "name": "long0"},
        ]
        async with gateway_with(
            sims, instances=instances, sections={"prefill": {"long_input_threshold": 100}}
        ) as gw:
            assert {await chat(gw, content="short") for _ in range(4)} == {"short0"}
            assert {await chat(gw, content="word " * 200) for _ in range(4)} == {"long0"}
            assert (await metric(gw, "gateway_requests_total", lane="prefill")) == 4.0


async def _disconnect_after(
    gw: Gateway,
    payload: dict[str, object],
    action: Callable[[aiohttp.ClientResponse], Awaitable[None]],
) -> None:
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + "/v1/chat/completions",
            json=payload,
            headers={"Authorization": f"Bearer {KEY}"},
        )
        await action(resp)
        resp.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_upstream_request(stream: bool) -> None:
    """A client that leaves, streaming or not, makes the instance see its request cancelled."""
    async with fleet(SLOW_DECODE) as sims, gateway_with(sims) as gw:
        payload = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 500,
            "stream": stream,
        }

        async def leave(resp: aiohttp.ClientResponse) -> None:
            if stream:
                await resp.content.readany()

        if stream:
            await _disconnect_after(gw, payload, leave)
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await _disconnect_after(gw, payload, leave)
        await eventually(lambda: sims[0].stats.cancelled == 1, timeout=1.0)
        await eventually(lambda: gw.dispatcher.snapshot().inflight == 0, timeout=1.0)
        assert sims[0].stats.running == 0


async def test_queued_client_that_leaves_never_reaches_an_instance() -> None:
    """A request waiting in the gateway queue whose client leaves is dropped from the queue."""
    async with (
        fleet(SLOW_DECODE) as sims,
        gateway_with(
            sims,
            instances=[{"url": sims[0].url, "max_num_seqs": 1}],
            sections={"dispatch": {"max_queue_per_instance": 0}},
        ) as gw,
    ):
        running = asyncio.create_task(chat(gw, max_tokens=30))
        await eventually(lambda: gw.dispatcher.snapshot().inflight == 1)
        queued = asyncio.create_task(chat(gw, max_tokens=1))
        await eventually(lambda: gw.dispatcher.snapshot().queues[_short()] == 1)
        queued.cancel()
        await eventually(lambda: gw.dispatcher.snapshot().queues[_short()] == 0, timeout=1.0)
        await running
        assert sims[0].stats.requests == 1
