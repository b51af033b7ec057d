"""The simulated vLLM's --scheduling-policy, against a real server on 127.0.0.1: the order
waiting requests start in, and what a request's `priority` does under each policy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from _sim_helpers import CHAT_URL, MakeSim, chat_body

from gateway.sim.sim_fleet import _build_parser
from gateway.sim.sim_vllm import SimInstance


async def eventually(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    """Wait until predicate() holds, failing after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def waiting_is(sim: SimInstance, count: int) -> Callable[[], bool]:
    """Whether the instance holds `count` requests waiting."""
    return lambda: sim.stats.waiting == count


async def start_order(
    sim: SimInstance, http: aiohttp.ClientSession, path: str, bodies: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """Send one request that holds the only slot, then `bodies` one by one, each queued
    before the next is sent; return the bodies' indexes in the order their first streamed
    token arrived, and their statuses."""
    order: list[int] = []
    statuses: dict[int, int] = {}

    async def one(index: int, body: dict[str, Any]) -> None:
        async with http.post(sim.url + path, json={**body, "stream": True}) as resp:
            statuses[index] = resp.status
            async for line in resp.content:
                if line.startswith(b"data: {") and index not in order:
                    if index >= 0:
                        order.append(index)
                    break
            await resp.read()

    blocker = asyncio.create_task(one(-1, {**bodies[0], "max_tokens": 20}))
    await eventually(lambda: sim.stats.running == 1)
    tasks = []
    for index, body in enumerate(bodies):
        tasks.append(asyncio.create_task(one(index, body)))
        await eventually(waiting_is(sim, index + 1))
    await asyncio.gather(blocker, *tasks)
    return order, [statuses[i] for i in range(len(bodies))]


async def test_priority_policy_starts_a_lower_priority_value_first(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """Under priority, a request queued later with a lower `priority` starts first; equal
    priorities keep their arrival order."""
    sim = await make_sim(max_num_seqs=1, scheduling_policy="priority")
    bodies = [
        chat_body(max_tokens=2, priority=1),
        chat_body(max_tokens=2, priority=1),
        chat_body(max_tokens=2),  # absent: 0
        chat_body(max_tokens=2, priority=-1),
    ]
    order, statuses = await start_order(sim, http, CHAT_URL, bodies)
    assert order == [3, 2, 0, 1]
    assert statuses == [200] * 4


async def test_priority_policy_on_completions(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """/v1/completions reads `priority` from its body as chat does."""
    sim = await make_sim(max_num_seqs=1, scheduling_policy="priority")
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2}
    order, _ = await start_order(sim, http, "/v1/completions", [{**body, "priority": 5}, body])
    assert order == [1, 0]


async def test_fcfs_serves_in_arrival_order_and_accepts_any_priority(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """The default policy is fcfs: a nonzero `priority` is answered 200 and ignored, as
    vLLM's v1 engine does (its v0 engine refused it)."""
    sim = await make_sim(max_num_seqs=1)
    assert sim.config.scheduling_policy == "fcfs"
    bodies = [chat_body(max_tokens=2, priority=9), chat_body(max_tokens=2, priority=-9)]
    order, statuses = await start_order(sim, http, CHAT_URL, bodies)
    assert order == [0, 1]
    assert statuses == [200, 200]


async def test_a_bad_priority_gets_vllms_400(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """A priority that is no integer is refused before it queues, in vLLM's error shape."""
    sim = await make_sim(scheduling_policy="priority")
    async with http.post(sim.url + CHAT_URL, json=chat_body(priority="urgent")) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert error["message"].startswith("priority: ")
    assert sim.stats.completed == 0


def test_fleet_cli_takes_the_policy() -> None:
    """`python -m gateway.sim.sim_fleet --scheduling-policy priority`; fcfs when not given."""
    parser = _build_parser("fleet")
    assert parser.parse_args([]).scheduling_policy == "fcfs"
    assert parser.parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
