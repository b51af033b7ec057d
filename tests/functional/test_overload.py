"""A flood fails fast: refused at once with 429, or 503 when its queue wait ran out; never 504.

The issue's probe, scaled down: a flood of streams into 2 instances of 2 slots with a
20 s request timeout. Before admission control every request past the first few waited
the full 20 s and got 504 without Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Any

import aiohttp
import openai
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

SIM = SimConfig(max_num_seqs=2, decode_s_per_token=0.01, prefill_tokens_per_s=1e6)


async def stream(session: aiohttp.ClientSession, gw: Gateway) -> tuple[int, float, dict[str, str]]:
    """One streamed completion: its status, how long until the answer began, its headers."""
    started = time.monotonic()
    body = {"prompt": "hello", "max_tokens": 20, "stream": True}
    async with session.post(
        gw.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as resp:
        answered = time.monotonic() - started
        data = await resp.read()
        if resp.status != 200:
            error = json.loads(data)["error"]
            assert error["code"] in ("overloaded", "queue_timeout"), error
        return resp.status, answered, dict(resp.headers)


async def test_flood_is_refused_fast_with_retry_after_and_never_504() -> None:
    """Over capacity: 200s, 429s (refused at arrival) and 503s (queue wait over), each with
    Retry-After; nothing waits until request_timeout, and each refusal is counted once."""
    async with (
        fleet(SIM, SIM) as sims,
        gateway_with(
            sims,
            sections={
                "gateway": {"request_timeout": 20},
                "dispatch": {"max_num_seqs": 2, "max_queue_per_instance": 0},
            },
        ) as gw,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        first = await asyncio.gather(*(stream(session, gw) for _ in range(80)))
        # The fleet's pace is known now: a second flood is refused at arrival.
        second = await asyncio.gather(*(stream(session, gw) for _ in range(80)))
        results = first + second
        statuses = [status for status, _, _ in results]
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(200) >= 8
        for status, answered, headers in results:
            assert answered < 10, "a request was held near its 20 s deadline"
            if status != 200:
                assert int(headers["Retry-After"]) >= 1
                # exactly, for the OpenAI SDK: never later than the whole seconds say
                assert 0 < int(headers["retry-after-ms"]) <= 1000 * int(headers["Retry-After"])
        # About rate x budget (20/s x 2 s) of the second flood are admitted, the rest
        # refused; and the admission was right: most of those admitted were served.
        second_statuses = [status for status, _, _ in second]
        assert second_statuses.count(429) >= 20, second_statuses
        assert second_statuses.count(200) > 2 * second_statuses.count(503), second_statuses
        rejections = gw.metrics.rejections
        assert rejections.labels("predicted_wait")._value.get() == statuses.count(429)
        assert rejections.labels("deadline")._value.get() == statuses.count(503)
        snapshot = gw.dispatcher.snapshot()
        assert snapshot.inflight == 0
        assert sum(snapshot.queues.values()) == 0


async def test_the_openai_sdk_comes_back_after_retry_after_ms_and_is_answered() -> None:
    """The real OpenAI SDK with its default two retries, in a flood: a request refused at
    arrival is sent again after the exact delay of `retry-after-ms`, sooner than the whole
    seconds of `Retry-After` would allow, and a refused request that came back was answered.
    """
    sent: dict[str, list[float]] = defaultdict(list)
    answers: dict[str, list[tuple[float, int, Any]]] = defaultdict(list)

    # The SDK's own HTTP client, whatever its module (httpx, httpx2), with hooks that see
    # every attempt, retries included.
    async def on_request(request: Any) -> None:
        sent[request.headers["x-test-call"]].append(time.monotonic())

    async def on_response(response: Any) -> None:
        call = response.request.headers["x-test-call"]
        answers[call].append((time.monotonic(), response.status_code, response.headers))

    hooks = {"request": [on_request], "response": [on_response]}
    async with (
        fleet(SIM, SIM) as sims,
        gateway_with(
            sims, sections={"dispatch": {"max_num_seqs": 2, "max_queue_per_instance": 0}}
        ) as gw,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        openai.AsyncOpenAI(
            base_url=gw.base_url,
            api_key=KEY,
            timeout=30,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks=hooks),
        ) as client,
    ):
        # A first flood teaches admission the fleet's pace, as above.
        await asyncio.gather(*(stream(session, gw) for _ in range(80)))

        async def call(n: int) -> bool:
            try:
                await client.chat.completions.create(
                    model="sim-model",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=20,
                    extra_headers={"x-test-call": str(n)},
                )
            except openai.RateLimitError:
                return False
            return True

        await asyncio.gather(*(call(n) for n in range(80)))

    came_back_answered = 0
    waits = []  # (seconds the SDK waited, what retry-after-ms said, what Retry-After said)
    for call_id, replies in answers.items():
        assert len(sent[call_id]) == len(replies) <= 3  # one try and two retries at most
        for (answered, status, headers), next_sent in zip(replies, sent[call_id][1:], strict=False):
            # refused at arrival (429) or when its queue wait ran out (503): both say when
            assert status in (429, 503), (status, headers)
            said_ms, said_s = int(headers["retry-after-ms"]), int(headers["Retry-After"])
            waits.append((next_sent - answered, said_ms / 1000, said_s))
        came_back_answered += len(replies) > 1 and replies[-1][1] == 200
    assert came_back_answered >= 1, answers
    # The SDK slept what retry-after-ms said (its clock may run a hair early, not late)...
    assert all(waited >= said - 0.005 for waited, said, _ in waits), waits
    # ...and not the whole seconds: some refusals came back before Retry-After's second.
    assert any(waited < whole <= 1 and said < 0.5 for waited, said, whole in waits), waits
