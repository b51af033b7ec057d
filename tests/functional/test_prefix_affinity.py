"""Prefix affinity end to end: the gateway in front of simulators with vLLM's prefix cache on."""

from __future__ import annotations

import asyncio
import random

import aiohttp
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig

CACHED = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=2e5, prefix_cache_blocks=4096)
GROUPS = 4
PER_GROUP = 5


def words(seed: int, size: int) -> str:
    """About `size` bytes of text, different for each seed from its first word."""
    rng = random.Random(seed)
    out = f"doc{seed} "
    while len(out) < size:
        out += "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 8))) + " "
    return out[:size]


async def ask(gw: Gateway, system: str, question: str) -> str:
    """One streamed chat (the gateway learns its TTFT); returns the serving instance."""
    body = {
        "model": "sim-model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp,
    ):
        await resp.read()
        assert resp.status == 200
        return resp.headers["X-Gateway-Instance"]


async def per_instance(gw: Gateway, name: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(gw.url + "/metrics")).text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["server"]] = sample.value
    return out


async def test_each_prefix_group_sticks_to_one_instance_and_hits_its_cache() -> None:
    """With least_time, a group's later requests go where its 4,000-token prefix is cached."""
    async with (
        fleet(*[CACHED] * 4) as sims,
        gateway_with(sims, sections={"dispatch": {"strategy": "least_time"}}) as gw,
    ):
        prefixes = [words(g, 16_000) for g in range(GROUPS)]
        homes: dict[int, set[str]] = {g: set() for g in range(GROUPS)}
        for i in range(PER_GROUP):
            for g in range(GROUPS):  # sequential: no load, so the cache decides
                homes[g].add(await ask(gw, prefixes[g], words(1000 + g * 100 + i, 800)))
        assert all(len(h) == 1 for h in homes.values()), homes
        queries = sum(s.stats.prefix_cache_queries for s in sims)
        hits = sum(s.stats.prefix_cache_hits for s in sims)
        # Every request but each group's first finds its prefix: 4/5 of about 4,000 of 4,200.
        assert hits / queries > 0.7


async def test_estimated_hits_track_the_instances_own_counters() -> None:
    """The gateway's estimated hit tokens per instance come near the instance's own count."""
    async with (
        fleet(*[CACHED] * 2) as sims,
        gateway_with(
            sims,
            sections={"dispatch": {"strategy": "least_time", "health_check_interval": 0.05}},
        ) as gw,
    ):
        prefixes = [words(g, 16_000) for g in range(2)]
        for i in range(4):
            for g in range(2):
                await ask(gw, prefixes[g], words(2000 + g * 100 + i, 800))
        sent = sum(s.stats.prefix_cache_hits for s in sims)
        assert sent > 0
        # Wait for a scrape that saw every instance's final count.
        theirs: dict[str, float] = {}
        for _ in range(100):
            theirs = await per_instance(gw, "gateway_instance_vllm_prefix_cache_hit_tokens_total")
            if sum(theirs.values()) == sent:
                break
            await asyncio.sleep(0.05)
        ours = await per_instance(gw, "gateway_prefix_estimated_hit_tokens_total")
        assert sum(theirs.values()) == sent
        for name in gw.names():
            # The estimate counts 64-token blocks of text, vLLM 16-token blocks of ids.
            assert abs(ours.get(name, 0) - theirs.get(name, 0)) <= 0.1 * max(theirs.values())
