"""The coding agents' one-shot against `gateway --simulate`, with the real SDKs the CLIs are
built on and the requests they send (recorded protocol: the CLIs themselves are not
installable from the registries CI reaches): Claude Code's Messages stream ends on its own
with `end_turn` (at `max_tokens` it asks to continue, three times, and gives up); Codex
CLI's Responses stream has the items it needs and completes."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from fakes import KEY, Gateway, gateway_with, until_available, write_config

from gateway.config import load as gateway_config
from gateway.process.serve import start_simulated
from gateway.sim.sim_fleet import stop_fleet
from gateway.sim.sim_vllm import SimInstance

pytestmark = pytest.mark.slow

CLAUDE_CODE_MAX_TOKENS = 32000  # what Claude Code asks for
CODEX_INPUT = [
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "List the files in this folder."}],
    }
]
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
    },
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
async def simulated() -> AsyncIterator[Gateway]:
    """The gateway before the fleet `--simulate` starts (start_simulated, as the CLI calls
    it) on two loopback ports, with the packaged defaults otherwise."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with tempfile.TemporaryDirectory() as folder:
        config = gateway_config.load(write_config(Path(folder), urls))
    sims = [s for s in await start_simulated(config) if isinstance(s, SimInstance)]
    try:
        async with gateway_with(sims) as gw:
            await until_available(gw)
            yield gw
    finally:
        await stop_fleet(sims)


async def test_claude_codes_one_shot_ends_on_its_own(simulated: Gateway) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=simulated.url, api_key=KEY, max_retries=0
    ) as client:
        kinds: list[str] = []
        async with client.messages.stream(
            model="sim-model",
            max_tokens=CLAUDE_CODE_MAX_TOKENS,
            system=[{"type": "text", "text": "You are Claude Code, a CLI for coding."}],
            tools=[
                {
                    "name": "Read",
                    "description": "Reads a file.",
                    "input_schema": {
                        "type": "object",
                        "properties": {"file_path": {"type": "string"}},
                        "required": ["file_path"],
                    },
                }
            ],
            messages=[{"role": "user", "content": "Say hello."}],
        ) as stream:
            async for event in stream:
                kinds.append(event.type)
            message = await stream.get_final_message()
    assert message.stop_reason == "end_turn"
    assert 0 < message.usage.output_tokens < CLAUDE_CODE_MAX_TOKENS
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "content_block_start" in kinds
    assert "content_block_stop" in kinds


async def test_codexs_one_shot_completes_with_the_items_it_needs(simulated: Gateway) -> None:
    async with openai.AsyncOpenAI(
        base_url=simulated.base_url, api_key=KEY, max_retries=0
    ) as client:
        kinds: list[str] = []
        body: dict[str, Any] = {
            "model": "sim-model",
            "instructions": "You are Codex, a coding agent running in the Codex CLI.",
            "input": CODEX_INPUT,
            "tools": [SHELL],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "store": False,
        }
        async with client.responses.stream(**body) as stream:  # no max_output_tokens
            async for event in stream:
                kinds.append(event.type)
            final = await stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    first_delta = kinds.index("response.output_text.delta")
    assert kinds.index("response.output_item.added") < first_delta
    assert kinds.index("response.content_part.added") < first_delta
    assert kinds[-1] == "response.completed"
