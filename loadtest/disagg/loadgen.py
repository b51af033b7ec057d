"""The SLO-attainment load generator: streamed /v1/completions on a Poisson schedule.

Every request has a prompt of exactly `prompt_tokens` simulator tokens (about 4 bytes a
token, `gateway.sim.sim_engine.count_tokens`), unique per request, and asks for exactly
`max_tokens` (`ignore_eos`, so a real vLLM also generates them all; the simulator always
does). Its outcome is timed from the send to each `data:` event that carries a choice:
one per token on vLLM and on the simulator.

A *stream* is one Poisson schedule sent to one base URL (`schedule.arrivals`); several run
at once to load several instances independently, or, with a per-request function of
their own, to send each request in two legs (`two_legs`, the decode-only setup).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import orjson

from gateway.proxy.disaggregate import prefill_body
from loadtest.disagg.slo import Outcome
from loadtest.harness import KEY

PROMPT_TOKENS = 512  # DistServe's Figure 1: input 512, output 64
OUTPUT_TOKENS = 64
MODEL = "sim-model"

Send = Callable[[int], Awaitable[Outcome]]  # request index -> its outcome


def prompt(index: int, tokens: int = PROMPT_TOKENS) -> str:
    """A text of exactly `tokens` simulator tokens (4 bytes each), unique per index."""
    if tokens < 3:
        raise ValueError(f"a prompt needs at least 3 tokens here, got {tokens}")
    return f"{index % 10**8:08d}" + " tok" * (tokens - 2)


def completion(
    index: int, max_tokens: int, *, prompt_tokens: int = PROMPT_TOKENS
) -> dict[str, Any]:
    """The body of one streamed completion of exactly `max_tokens` tokens."""
    return {
        "model": MODEL,
        "prompt": prompt(index, prompt_tokens),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of `body`, as the gateway (and vLLM's own proxies) send it."""
    leg: dict[str, Any] = orjson.loads(prefill_body(body))
    return leg


async def stream(
    http: aiohttp.ClientSession, base_url: str, body: dict[str, Any], request_id: str
) -> Outcome:
    """POST a streamed completion to base_url (without /v1) and time its tokens."""
    headers = {"X-Request-Id": request_id}
    sent = time.perf_counter()
    token_times: list[float] = []
    try:
        async with http.post(base_url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                return Outcome(None, None, 0, f"status {resp.status}")
            buffer = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                        token_times.append(now)
    except (aiohttp.ClientError, OSError) as exc:
        return Outcome(None, None, 0, type(exc).__name__)
    return Outcome.from_times(sent, token_times)


def one_leg(
    http: aiohttp.ClientSession,
    base_url: str,
    max_tokens: int,
    label: str,
    prompt_tokens: Callable[[int], int] = lambda index: PROMPT_TOKENS,
) -> Send:
    """Each request straight to base_url; `prompt_tokens` gives request i's prompt size."""

    async def send(index: int) -> Outcome:
        body = completion(index, max_tokens, prompt_tokens=prompt_tokens(index))
        return await stream(http, base_url, body, f"{label}-{index}")

    return send


def two_legs(
    http: aiohttp.ClientSession, prefill_url: str, decode_url: str, max_tokens: int, label: str
) -> Send:
    """Each request's prefill leg to prefill_url, then its decode leg to decode_url with the
    params the prefill answered; timed from the decode leg's send (the decode instance's view)."""

    async def send(index: int) -> Outcome:
        body, request_id = completion(index, max_tokens), f"{label}-{index}"
        try:
            async with http.post(
                prefill_url + "/v1/completions",
                json=prefill_leg(body),
                headers={"X-Request-Id": request_id},
            ) as resp:
                answer = await resp.json()
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return Outcome(None, None, 0, f"prefill leg: {type(exc).__name__}")
        params = answer.get("kv_transfer_params")
        if resp.status != 200 or not isinstance(params, dict):
            return Outcome(None, None, 0, f"prefill leg: status {resp.status}, no params")
        return await stream(http, decode_url, {**body, "kv_transfer_params": params}, request_id)

    return send


async def run_stream(
    times: Sequence[float], send: Send, *, start: float, limit: float
) -> list[Outcome]:
    """Send request i at `start + times[i]` (perf_counter seconds); what has not finished
    `limit` seconds after `start` counts as failed."""

    async def one(index: int, at: float) -> Outcome:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await send(index)

    tasks = [asyncio.create_task(one(i, at)) for i, at in enumerate(times)]
    await asyncio.wait(tasks, timeout=max(0.0, start + limit - time.perf_counter()))
    outcomes = []
    for task in tasks:
        if not task.done():
            task.cancel()
            outcomes.append(Outcome(None, None, 0, "unfinished"))
        elif (error := task.exception()) is not None:
            outcomes.append(Outcome(None, None, 0, type(error).__name__))
        else:
            outcomes.append(task.result())
    await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


async def run_streams(
    streams: Sequence[tuple[Sequence[float], Send]], *, limit: float
) -> list[list[Outcome]]:
    """Several streams at once, from one common start; each one's outcomes."""
    start = time.perf_counter() + 0.05
    return list(
        await asyncio.gather(*(run_stream(t, s, start=start, limit=limit) for t, s in streams))
    )


def session() -> aiohttp.ClientSession:
    """A client session whose pool never limits the load, with no total timeout (the run's
    own limit bounds it)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    # The gateway's key; the simulators and vllm-router take no key and ignore it.
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        headers={"Authorization": f"Bearer {KEY}"},
    )
