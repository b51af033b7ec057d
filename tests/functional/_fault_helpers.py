"""The set-up the failure tests share (test_faults_upstream.py, test_faults_clients_and_load.py).

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
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
from fakes import KEY, Gateway, fleet, gateway_with
from faultproxy import FaultProxy
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig

SLOW = SimConfig(decode_s_per_token=0.02, prefill_tokens_per_s=1e6, max_num_seqs=64)


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
