"""README's "Failure behaviour" rows for clients and load, provoked for real and checked end to
end: a client leaving while queued, waiting or streaming; ten times capacity; retry storms.

The set-up (simulated instances behind fault proxies, round robin, no ejection) is described
in _fault_helpers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from _fault_helpers import (
    MESSAGES,
    SLOW,
    closed_after,
    proxied,
    scrape,
    sdk,
    settled,
    stream_text,
    value,
)
from faultproxy import eventually

from gateway.sim.sim_vllm import SimConfig

INSTANT = SimConfig(instant=True)


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
        await _leave_after(queued, lambda: gw.dispatcher.snapshot().queues[_short()] == 1)
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
        peaks = {"inflight": 0, "queued": 0, "tasks": 0}
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                snapshot = gw.dispatcher.snapshot()
                peaks["inflight"] = max(peaks["inflight"], snapshot.inflight)
                peaks["queued"] = max(peaks["queued"], snapshot.queues[_short()])
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
