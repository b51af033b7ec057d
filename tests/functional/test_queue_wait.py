"""`gateway_queue_wait_seconds` observes every placed request, 0 for one placed at once, so
its percentiles are those of all requests (not only the unlucky ones that queued) and its
panel has data on a fleet that never queues."""

from __future__ import annotations

import asyncio

import aiohttp
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig

AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
SHORT = {"lane": "short", "priority": "interactive"}


async def waits(gw: Gateway) -> dict[str, float]:
    """The short lane's interactive queue-wait histogram: count, sum and the 25 ms bucket,
    and the default key's summary."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if family.name == "gateway_queue_wait_seconds" and labels.items() >= SHORT.items():
                if sample.name.endswith("_bucket"):
                    if labels["le"] == "0.025":
                        found["fast"] = sample.value
                else:
                    found[sample.name.rsplit("_", 1)[-1]] = sample.value
            if family.name == "gateway_key_queue_wait_seconds" and labels["key"] == "default":
                found["key_" + sample.name.rsplit("_", 1)[-1]] = sample.value
    return found


async def stream(session: aiohttp.ClientSession, gw: Gateway) -> int:
    async with session.post(gw.url + "/v1/chat/completions", json=BODY, headers=AUTH) as r:
        await r.read()
        return r.status


async def test_a_request_placed_at_once_waits_0_and_one_that_queued_its_time() -> None:
    """Two requests one after the other are placed at once: two observations of 0. Then two
    at once on one slot: the first at once (0), the second after the first's answer."""
    sim = SimConfig(max_num_seqs=1, decode_s_per_token=0.02, prefill_tokens_per_s=1e6)
    dispatch = {"max_num_seqs": 1, "max_queue_per_instance": 0}
    async with (
        fleet(sim) as sims,
        gateway_with(sims, sections={"dispatch": dispatch}) as gw,
        aiohttp.ClientSession() as session,
    ):
        assert (await waits(gw))["count"] == 0
        for _ in range(2):
            assert await stream(session, gw) == 200
        alone = await waits(gw)
        statuses = await asyncio.gather(stream(session, gw), stream(session, gw))
        assert statuses == [200, 200]
        both = await waits(gw)
    assert (alone["count"], alone["sum"], alone["fast"]) == (2, 0.0, 2)
    assert (alone["key_count"], alone["key_sum"]) == (2, 0.0)
    assert both["count"] == 4
    assert both["fast"] == 3  # the three placed at once
    assert 0.1 < both["sum"] < 2.0  # the one that waited out a stream of 8 tokens at 20 ms
    assert both["key_count"] == 4
