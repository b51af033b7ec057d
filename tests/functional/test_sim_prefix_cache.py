"""The simulated vLLM's prefix cache, through its HTTP API on 127.0.0.1: TTFT, eviction, metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig, SimInstance, count_message_tokens
from loadtest.workloads import group_prefix, unique_word

PREFILL = 10_000.0  # tokens/s: slow enough that 4,000 cached tokens are 0.4 s of TTFT
PREFIX = 4000
SUFFIX = 200


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp client session."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def sims() -> AsyncIterator[list[SimInstance]]:
    """Started simulators, stopped after the test."""
    started: list[SimInstance] = []
    yield started
    for sim in started:
        await sim.stop()


async def start(sims: list[SimInstance], **overrides: Any) -> SimInstance:
    sim = SimInstance(SimConfig(**overrides))
    await sim.start()
    sims.append(sim)
    return sim


def messages(group: int, request: int) -> list[dict[str, str]]:
    """One user message: a group's 4,000-token prefix, then a 200-token suffix of its own."""
    suffix = unique_word(request) + " tok" * (SUFFIX - 1)
    return [{"role": "user", "content": group_prefix(group, PREFIX, seed=0) + suffix}]


async def ttft(http: aiohttp.ClientSession, sim: SimInstance, body: dict[str, Any]) -> float:
    """Seconds from sending a streamed chat request to its first data line."""
    payload = {"model": "sim-model", "max_tokens": 2, "stream": True, **body}
    started = time.perf_counter()
    async with http.post(sim.url + "/v1/chat/completions", json=payload) as resp:
        assert resp.status == 200
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - started
        assert first is not None
        return first


async def complete(http: aiohttp.ClientSession, sim: SimInstance, prompt: Any) -> None:
    """One completion of a prompt (text or token ids), one output token."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def counters(http: aiohttp.ClientSession, sim: SimInstance) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total) from /metrics."""
    async with http.get(sim.url + "/metrics") as resp:
        text = await resp.text()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return samples["vllm:prefix_cache_queries_total"], samples["vllm:prefix_cache_hits_total"]


def cached(prompt: int, shared: int, block: int = 16) -> int:
    """Tokens vLLM takes from the cache: whole shared blocks, at most prompt - 1 tokens."""
    return min(shared, prompt - 1) // block * block


async def test_cached_prefix_cuts_ttft_as_the_model_predicts(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """The second request with a cached 4,000-token prefix prefills only its uncached tokens."""
    sim = await start(sims, prefill_tokens_per_s=PREFILL, prefix_cache_blocks=4096)
    first, second = messages(0, 0), messages(0, 1)
    prompt = count_message_tokens(first)  # 4 template tokens + 4,000 + 200
    hit = cached(prompt, shared=4 + PREFIX)
    assert hit == 4000
    cold = await ttft(http, sim, {"messages": first})
    warm = await ttft(http, sim, {"messages": second})
    expected_cold, expected_warm = prompt / PREFILL, (prompt - hit) / PREFILL  # 0.42 s, 0.02 s
    assert expected_cold - 0.01 <= cold <= expected_cold + 0.15
    assert expected_warm - 0.01 <= warm <= expected_warm + 0.15
    assert sim.stats.prefix_cache_hits == hit
    assert sim.stats.prefix_cache_queries == 2 * prompt


async def test_cache_off_changes_nothing(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """Off by default: the same two requests take the full prefill and nothing is counted."""
    sim = await start(sims, prefill_tokens_per_s=PREFILL)
    prompt = count_message_tokens(messages(0, 0))
    times = [await ttft(http, sim, {"messages": messages(0, i)}) for i in range(2)]
    for took in times:
        assert prompt / PREFILL - 0.01 <= took <= prompt / PREFILL + 0.15
    assert await counters(http, sim) == (0.0, 0.0)
    assert sim.engine.prefix_cache is None


async def test_eviction_forgets_the_least_recently_used_prefix(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """With room for one prompt, the older group's prefix is gone and the newer one still hits."""
    prompt = count_message_tokens(messages(0, 0))
    sim = await start(sims, prefix_cache_blocks=prompt // 16)  # one prompt's full blocks
    for group, request in [(0, 0), (1, 1)]:
        await ttft(http, sim, {"messages": messages(group, request)})
    assert sim.stats.prefix_cache_hits == 0
    await ttft(http, sim, {"messages": messages(1, 2)})
    assert sim.stats.prefix_cache_hits == PREFIX  # group 1 was the most recent
    await ttft(http, sim, {"messages": messages(0, 3)})
    assert sim.stats.prefix_cache_hits == PREFIX  # group 0 was evicted
    assert len(sim.engine.prefix_cache or []) <= prompt // 16


async def test_metrics_count_prompt_tokens_and_cached_tokens(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """queries_total counts prompt tokens, hits_total cached ones; the last token is computed."""
    sim = await start(sims, prefix_cache_blocks=1000)
    ids = list(range(1000, 1064))  # four full blocks
    await complete(http, sim, ids)
    await complete(http, sim, ids)  # all cached, yet its last block is recomputed: 48 hit
    longer = [*ids, *range(5000, 5100)]
    await complete(http, sim, longer)  # shares the four blocks: 64 hit
    text = "abcd" * 40  # a text prompt of 40 tokens, tokenized like /tokenize does
    await complete(http, sim, text)
    await complete(http, sim, text)  # 32 hit
    assert await counters(http, sim) == (64 + 64 + 164 + 40 + 40, 48 + 64 + 32)
    assert (sim.stats.prefix_cache_queries, sim.stats.prefix_cache_hits) == (372, 144)


async def test_a_different_first_block_breaks_the_chain(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """Later blocks equal to a cached prompt's do not hit once the first block differs."""
    sim = await start(sims, prefix_cache_blocks=1000)
    ids = list(range(2000, 2400))
    await complete(http, sim, ids)
    await complete(http, sim, [7, *ids[1:]])
    assert sim.stats.prefix_cache_hits == 0
    await complete(http, sim, [*ids[:16], 7, *ids[17:]])  # differs in block 2: one block hits
    assert sim.stats.prefix_cache_hits == 16
