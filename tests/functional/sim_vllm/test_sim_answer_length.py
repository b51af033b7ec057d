"""Simulated answers end on their own, against a real server on 127.0.0.1: chat,
completions, Messages and Responses stop at the answer's natural length ("stop",
"end_turn", status completed) unless max_tokens cuts them ("length", "max_tokens",
incomplete); vLLM's ignore_eos generates all of max_tokens."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from _sim_helpers import CHAT_URL, MakeSim, chat_body

from gateway.sim.sim_engine import answer_tokens
from gateway.sim.sim_vllm import SimInstance

MEDIAN = 30
BIG = 4000  # far past any natural length a test prompt draws at this median


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


def natural(sim: SimInstance, prompt: object) -> int:
    return answer_tokens(sim.config.seed, prompt, sim.config.answer_tokens_median)


async def quick(make_sim: MakeSim, **overrides: Any) -> SimInstance:
    return await make_sim(
        decode_s_per_token=0.0005, answer_tokens_median=MEDIAN, seed=11, **overrides
    )


async def test_a_chat_ends_on_its_own_the_same_way_every_time(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """Under a large max_tokens a chat stops at its natural length with "stop", and the same
    request gets the same length again, streamed or not."""
    sim = await quick(make_sim)
    body = chat_body(BIG)
    expected = natural(sim, [[], body["messages"]])
    assert expected < BIG
    first = await post(http, sim.url + CHAT_URL, body)
    again = await post(http, sim.url + CHAT_URL, body)
    assert first["choices"][0]["finish_reason"] == "stop"
    assert first["usage"]["completion_tokens"] == expected
    assert again["usage"]["completion_tokens"] == expected
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(sim.url + CHAT_URL, json=stream) as resp:
        chunks = [
            json.loads(line.removeprefix(b"data: "))
            for line in (await resp.read()).split(b"\n\n")
            if line.startswith(b"data: {")
        ]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop"
    assert finishes[:-1] == [None] * (len(finishes) - 1)
    assert chunks[-1]["usage"]["completion_tokens"] == expected


async def test_different_prompts_end_at_different_lengths(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """Lengths follow the prompt: ten prompts do not all answer alike."""
    sim = await quick(make_sim, instant=True)
    lengths = set()
    for i in range(10):
        answer = await post(http, sim.url + CHAT_URL, chat_body(BIG, content=f"task {i}"))
        lengths.add(answer["usage"]["completion_tokens"])
    assert len(lengths) > 3


async def test_max_tokens_cuts_an_answer_with_length(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """A max_tokens under the natural length ends the answer there, with "length"."""
    sim = await quick(make_sim)
    body = chat_body(BIG)
    cut = natural(sim, [[], body["messages"]]) - 1
    answer = await post(http, sim.url + CHAT_URL, {**body, "max_tokens": cut})
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == cut


async def test_ignore_eos_generates_all_of_max_tokens(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """With vLLM's ignore_eos a chat and a completion run to max_tokens, as load tests need."""
    sim = await quick(make_sim)
    limit = natural(sim, [[], chat_body()["messages"]]) + 20
    chat = await post(http, sim.url + CHAT_URL, chat_body(limit, ignore_eos=True))
    assert chat["usage"]["completion_tokens"] == limit
    assert chat["choices"][0]["finish_reason"] == "length"
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 300, "ignore_eos": True}
    completion = await post(http, sim.url + "/v1/completions", body)
    assert completion["usage"]["completion_tokens"] == 300
    assert completion["choices"][0]["finish_reason"] == "length"


async def test_a_completion_ends_on_its_own(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """A text completion stops at its prompt's natural length with "stop"."""
    sim = await quick(make_sim)
    body = {"model": "sim-model", "prompt": "once upon a time", "max_tokens": BIG}
    answer = await post(http, sim.url + "/v1/completions", body)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == natural(sim, "once upon a time")


async def test_a_message_ends_with_end_turn_and_ignores_ignore_eos(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """A Messages answer ends with end_turn at its natural length, or max_tokens when cut;
    vLLM's Messages request has no ignore_eos, so the field changes nothing there."""
    sim = await quick(make_sim)
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": "sim-model", "max_tokens": BIG, "messages": messages}
    expected = natural(sim, [[], messages])
    whole = await post(http, sim.url + "/v1/messages", body)
    assert whole["stop_reason"] == "end_turn"
    assert whole["usage"]["output_tokens"] == expected
    ignored = await post(http, sim.url + "/v1/messages", {**body, "ignore_eos": True})
    assert ignored["usage"]["output_tokens"] == expected
    cut = await post(http, sim.url + "/v1/messages", {**body, "max_tokens": 1})
    assert cut["stop_reason"] == "max_tokens"


async def test_a_response_completes_on_its_own_and_ignore_eos_fills_it(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """A response without max_output_tokens (as Codex CLI sends it) completes at its natural
    length when the instance has no default limit (vLLM's: the rest of the context); with
    ignore_eos it runs to max_output_tokens and is incomplete."""
    sim = await quick(make_sim, default_max_tokens=None)
    body = {"model": "sim-model", "input": "hello"}
    expected = natural(sim, [[], [{"role": "user", "content": "hello"}]])
    whole = await post(http, sim.url + "/v1/responses", body)
    assert whole["status"] == "completed"
    assert whole["incomplete_details"] is None
    assert whole["usage"]["output_tokens"] == expected
    full = await post(
        http, sim.url + "/v1/responses", {**body, "max_output_tokens": 200, "ignore_eos": True}
    )
    assert full["status"] == "incomplete"
    assert full["usage"]["output_tokens"] == 200
