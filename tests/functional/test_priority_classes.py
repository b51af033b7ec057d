"""Priority classes through the gateway, with the real OpenAI SDK: a batch key's request
waits behind an interactive one, carries vLLM's `priority` only to instances that run
the priority scheduler, and is counted against [slo.batch]."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
import structlog
from aiohttp import web
from fakes import Gateway, gateway_with, until_available
from prometheus_client.parser import text_string_to_metric_families

from gateway.proxy import jsoncodec
from gateway.sim.sim_vllm import SimConfig, SimInstance

CHAT_KEY = "sk-chat-0123456789abcdef"
JOBS_KEY = "sk-jobs-0123456789abcdef"
NIGHTLY_KEY = "sk-nightly-0123456789abcd"
KEYS = [
    {"name": "chat", "key": CHAT_KEY},
    {"name": "jobs", "key": JOBS_KEY, "priority": "batch"},
    {"name": "nightly", "key": NIGHTLY_KEY, "priority": 5},
]
HI = [{"role": "user", "content": "hi"}]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Recording:
    """The bodies a simulated instance received on its chat route, in arrival order."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and request.path.endswith("/chat/completions"):
            self.bodies.append(jsoncodec.loads(await request.read()))
        return await handler(request)


@contextlib.asynccontextmanager
async def recorded(config: SimConfig) -> AsyncIterator[tuple[SimInstance, Recording]]:
    sim, recording = SimInstance(config), Recording()
    sim.app.middlewares.append(recording.middleware)
    await sim.start()
    try:
        yield sim, recording
    finally:
        await sim.stop()


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


async def chat(gw: Gateway, key: str, **extra: Any) -> None:
    async with client(gw, key) as c:
        await c.chat.completions.create(
            model="sim-model", messages=HI, max_tokens=2, extra_body=extra or None
        )


@pytest.mark.parametrize(
    ("key", "sent", "received"),
    [
        (CHAT_KEY, {}, None),  # interactive: 0, vLLM's default, the body untouched
        (JOBS_KEY, {}, 1),
        (NIGHTLY_KEY, {}, 5),  # a key's own number
        (JOBS_KEY, {"priority": -3}, 1),  # a client may not jump its key's class
        (JOBS_KEY, {"priority": 7}, 7),  # it may yield
        (CHAT_KEY, {"priority": 2}, 2),
    ],
)
async def test_a_priority_instance_gets_the_keys_priority(
    key: str, sent: dict[str, Any], received: int | None
) -> None:
    async with recorded(SimConfig(instant=True)) as (sim, recording):
        instance = {"url": sim.url, "scheduling_policy": "priority"}
        async with gateway_with([sim], instances=[instance], channel={"keys": KEYS}) as gw:
            await chat(gw, key, **sent)
    (body,) = recording.bodies
    assert body.get("priority") == received
    assert body["messages"] == HI  # the rest as the client sent it


async def test_an_fcfs_instance_gets_the_body_as_sent() -> None:
    """Without the priority scheduler the field means nothing (vLLM v1 ignores it, v0
    refused a nonzero one): nothing is added."""
    async with (
        recorded(SimConfig(instant=True)) as (sim, recording),
        gateway_with([sim], channel={"keys": KEYS}) as gw,
    ):
        await chat(gw, JOBS_KEY)
        await chat(gw, NIGHTLY_KEY)
    assert [b.get("priority") for b in recording.bodies] == [None, None]


async def test_a_batch_request_waits_behind_a_later_interactive_one() -> None:
    """One running slot, no queue at the instance: while an interactive request runs, a
    batch request and then an interactive one wait in the gateway's queue; the
    interactive one goes first. The queue wait is counted per class, and the batch
    request's access line names its class."""
    slow = SimConfig(max_num_seqs=1, decode_s_per_token=0.05)
    async with recorded(slow) as (sim, recording):
        instance = {"url": sim.url, "max_num_seqs": 1}
        sections = {"dispatch": {"max_queue_per_instance": 0, "health_check_interval": 0.2}}
        async with gateway_with(
            [sim], instances=[instance], sections=sections, channel={"keys": KEYS}
        ) as gw:
            with structlog.testing.capture_logs() as events:
                first = asyncio.create_task(chat(gw, CHAT_KEY, max_tokens=10))
                await _until(lambda: len(recording.bodies) == 1)
                batch = asyncio.create_task(chat(gw, JOBS_KEY, user="batch"))
                await asyncio.sleep(0.05)  # the batch one is queued first
                interactive = asyncio.create_task(chat(gw, CHAT_KEY, user="interactive"))
                await asyncio.gather(first, batch, interactive)
            async with aiohttp.ClientSession() as session:
                text = await (await session.get(gw.url + "/metrics")).text()
    assert [b.get("user") for b in recording.bodies[1:]] == ["interactive", "batch"]
    waits = {
        (sample.labels["priority"], sample.name.rpartition("_")[2]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("gateway_queue_wait_seconds_count", "gateway_queue_wait_seconds_sum")
        and sample.labels["lane"] == "short"
    }
    # The batch request waited out the first one's answer and the later interactive one's.
    assert waits["batch", "count"] == 1
    assert waits["batch", "sum"] > waits["interactive", "sum"] > 0
    lines = [e for e in events if e["event"] == "request"]
    assert sorted((line["key"], line["priority"]) for line in lines) == [
        ("chat", None),
        ("chat", None),
        ("jobs", "batch"),
    ]


async def test_a_full_queue_of_batch_requests_refuses_batch_not_interactive() -> None:
    """gateway_queue_size 1, one running slot: with a batch request waiting, another batch
    request gets 429 queue_full, while an interactive one waits and is answered."""
    slow = SimConfig(max_num_seqs=1, decode_s_per_token=0.05)
    async with recorded(slow) as (sim, recording):
        instance = {"url": sim.url, "max_num_seqs": 1}
        dispatch = {"max_queue_per_instance": 0, "gateway_queue_size": 1}
        async with gateway_with(
            [sim], instances=[instance], sections={"dispatch": dispatch}, channel={"keys": KEYS}
        ) as gw:
            first = asyncio.create_task(chat(gw, CHAT_KEY, max_tokens=10))
            await _until(lambda: len(recording.bodies) == 1)
            batch = asyncio.create_task(chat(gw, JOBS_KEY, user="batch"))
            await asyncio.sleep(0.05)  # the batch one fills the queue
            with pytest.raises(openai.RateLimitError) as refused:
                await chat(gw, JOBS_KEY, user="second batch")
            await chat(gw, CHAT_KEY, user="interactive")
            await asyncio.gather(first, batch)
    assert refused.value.response.headers["Retry-After"]
    assert [b.get("user") for b in recording.bodies[1:]] == ["interactive", "batch"]


async def test_a_batch_stream_is_counted_against_the_batch_objectives() -> None:
    """A batch stream is counted with priority="batch" against [slo.batch]: a TTFT
    objective the interactive class would miss, the batch one meets."""
    slo = {"ttft": 0.001, "batch": {"ttft": 60}}
    async with (
        recorded(SimConfig(instant=True)) as (sim, _),
        gateway_with([sim], sections={"slo": slo}, channel={"keys": KEYS}) as gw,
    ):
        for key in (CHAT_KEY, JOBS_KEY):
            async with client(gw, key) as c:
                stream = await c.chat.completions.create(
                    model="sim-model", messages=HI, max_tokens=2, stream=True
                )
                async for _ in stream:
                    pass
        async with aiohttp.ClientSession() as session:
            text = await (await session.get(gw.url + "/metrics")).text()
    server = sim.url.removeprefix("http://")

    def slo_count(priority: str, result: str) -> float:
        labels = {"lane": "short", "server": server, "objective": "ttft", "priority": priority}
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "gateway_slo_requests_total"
            and sample.labels == {**labels, "result": result}
        )

    assert (slo_count("interactive", "missed"), slo_count("batch", "met")) == (1, 1)
    assert (slo_count("interactive", "met"), slo_count("batch", "missed")) == (0, 0)


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_both_hops_of_a_disaggregated_request_carry_the_priority() -> None:
    """In a fleet with prefill instances, the prefill leg and the decode leg of a batch
    request both reach priority instances with the key's priority."""
    card = SimConfig(
        decode_s_per_token=0.002, prefill_tokens_per_s=50_000, kv_transfer=True,
        kv_link_bytes_per_s=1e12,
    )  # fmt: skip
    sections = {
        "dispatch": {"health_check_interval": 0.1},
        "prefill": {"long_input_threshold": 400},
        "slo": {"tpot": 0.005},
    }
    async with recorded(card) as (prefill, on_prefill), recorded(card) as (decode, on_decode):
        instances = [
            {"url": prefill.url, "role": "prefill", "scheduling_policy": "priority"},
            {"url": decode.url, "role": "decode", "scheduling_policy": "priority"},
        ]
        async with gateway_with(
            [prefill, decode], instances=instances, sections=sections, channel={"keys": KEYS}
        ) as gw:
            await until_available(gw)
            long = [{"role": "user", "content": "tell me more " * 300}]
            async with client(gw, JOBS_KEY) as c:
                await c.chat.completions.create(model="sim-model", messages=long, max_tokens=3)
    (prefill_leg,) = on_prefill.bodies
    assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill_leg["priority"] == 1
    assert on_decode.bodies[-1]["kv_transfer_params"]["remote_block_ids"]
    assert on_decode.bodies[-1]["priority"] == 1
