"""The simulated vLLM's prompt token counts with tools, against a real server on 127.0.0.1:
chat, Messages (tools and system) and Responses count the tool schemas the chat template
writes into the prompt, with and without the prefix cache."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from _sim_helpers import CHAT_URL, MakeSim, chat_body

from gateway.sim.sim_engine import count_message_tokens, count_tool_tokens

HELLO = [{"role": "user", "content": "hello there"}]
# About 20 KB of schemas, as a coding agent sends with every request.
SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string", "description": "d" * 900}},
    "required": ["path"],
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": f"t{i}", "description": "x", "parameters": SCHEMA}}
    for i in range(20)
]
ANTHROPIC_TOOLS = [{"name": f"t{i}", "description": "x", "input_schema": SCHEMA} for i in range(20)]
RESPONSES_TOOLS = [
    {"type": "function", "name": f"t{i}", "description": "x", "parameters": SCHEMA}
    for i in range(20)
]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


@pytest.mark.parametrize("blocks", [0, 4096])
async def test_chat_counts_its_tools(
    make_sim: MakeSim, http: aiohttp.ClientSession, blocks: int
) -> None:
    """A chat with 20 KB of tools has thousands of prompt tokens more than without, the
    tools' own count exactly, whether the prefix cache tokenizes it or not."""
    sim = await make_sim(instant=True, prefix_cache_blocks=blocks)
    bare = await post(http, sim.url + CHAT_URL, chat_body(1))
    tooled = await post(http, sim.url + CHAT_URL, chat_body(1, tools=CHAT_TOOLS))
    extra = tooled["usage"]["prompt_tokens"] - bare["usage"]["prompt_tokens"]
    assert extra == count_tool_tokens(CHAT_TOOLS)
    assert extra > 5000


async def test_chat_tools_that_are_not_a_list_are_a_400(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """tools must be a list of objects, as vLLM's request model has it."""
    sim = await make_sim(instant=True)
    async with http.post(sim.url + CHAT_URL, json=chat_body(1, tools="shell")) as resp:
        assert resp.status == 400
        assert "tools" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("blocks", [0, 4096])
async def test_messages_count_tools_and_system(
    make_sim: MakeSim, http: aiohttp.ClientSession, blocks: int
) -> None:
    """A message's input_tokens count the system prompt and the tools (as the OpenAI function
    tools vLLM converts them to); count_tokens says the same number."""
    sim = await make_sim(instant=True, prefix_cache_blocks=blocks)
    system = "s" * 4000
    body = {"model": "sim-model", "max_tokens": 1, "messages": HELLO}
    bare = await post(http, sim.url + "/v1/messages", body)
    full = {**body, "system": system, "tools": ANTHROPIC_TOOLS}
    answer = await post(http, sim.url + "/v1/messages", full)
    converted = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": "x", "parameters": SCHEMA},
        }
        for t in ANTHROPIC_TOOLS
    ]
    expected = count_tool_tokens(converted) + count_message_tokens(
        [{"role": "system", "content": system}, *HELLO]
    )
    assert answer["usage"]["input_tokens"] == expected
    assert answer["usage"]["input_tokens"] - bare["usage"]["input_tokens"] > 6000
    counted = await post(
        http,
        sim.url + "/v1/messages/count_tokens",
        {k: v for k, v in full.items() if k != "max_tokens"},
    )
    assert counted["input_tokens"] == expected


@pytest.mark.parametrize("blocks", [0, 4096])
async def test_responses_count_tools_and_instructions(
    make_sim: MakeSim, http: aiohttp.ClientSession, blocks: int
) -> None:
    """A response's input_tokens count the instructions and the function tools."""
    sim = await make_sim(instant=True, prefix_cache_blocks=blocks)
    body = {"model": "sim-model", "input": "hello there", "max_output_tokens": 1}
    bare = await post(http, sim.url + "/v1/responses", body)
    full = {**body, "instructions": "i" * 400, "tools": RESPONSES_TOOLS}
    answer = await post(http, sim.url + "/v1/responses", full)
    expected = count_tool_tokens(RESPONSES_TOOLS) + count_message_tokens(
        [{"role": "system", "content": "i" * 400}, *HELLO]
    )
    assert answer["usage"]["input_tokens"] == expected
    assert bare["usage"]["input_tokens"] == count_message_tokens(HELLO)


@pytest.mark.parametrize("details", [False, True])
async def test_prompt_tokens_details_say_the_cached_tokens_only_when_enabled(
    make_sim: MakeSim, http: aiohttp.ClientSession, details: bool
) -> None:
    """vLLM's --enable-prompt-tokens-details: the second identical prompt's usage says the
    whole blocks found cached (its last token is always computed); off, no details."""
    sim = await make_sim(
        prefix_cache_blocks=4096, block_size=16, enable_prompt_tokens_details=details
    )
    body = chat_body(content="tell me more " * 40)
    first = (await post(http, sim.url + CHAT_URL, body))["usage"]
    second = (await post(http, sim.url + CHAT_URL, body))["usage"]
    if not details:
        assert first["prompt_tokens_details"] is None
        assert second["prompt_tokens_details"] is None
        return
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == (second["prompt_tokens"] - 1) // 16 * 16
    assert cached > 0
