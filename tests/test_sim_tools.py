"""The simulated vLLM's tokenizer over tool definitions: vLLM renders the tools into the
prompt through the chat template, so their JSON costs about what its text costs."""

from __future__ import annotations

import json
from typing import Any

from gateway.sim.sim_engine import count_tokens, count_tool_tokens, tokenize_tools


def tool(index: int, description_bytes: int) -> dict[str, Any]:
    """A function tool as Claude Code or Codex CLI sends one, with a long description."""
    return {
        "type": "function",
        "function": {
            "name": f"tool_{index}",
            "description": "x" * description_bytes,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "a file"}},
                "required": ["path"],
            },
        },
    }


def test_twenty_kilobytes_of_tools_cost_thousands_of_tokens() -> None:
    """20 tools of about 1 KB each: about a token per 4 bytes of their JSON, not a handful."""
    tools = [tool(i, 900) for i in range(20)]
    size = len(json.dumps(tools, separators=(",", ":")).encode())
    assert size > 20_000
    assert count_tool_tokens(tools) == count_tokens(json.dumps(tools, separators=(",", ":")))
    assert size // 4 <= count_tool_tokens(tools) <= size // 4 + 1


def test_no_tools_cost_nothing() -> None:
    """A request without tools, or with an empty list, adds no prompt tokens."""
    assert count_tool_tokens(None) == count_tool_tokens([]) == 0
    assert tokenize_tools(None) == tokenize_tools([]) == []


def test_tool_ids_are_as_many_as_the_count_and_follow_the_schema() -> None:
    """The prefix cache's ids of the tools are count_tool_tokens of them, and two different
    schemas give different ids (a changed tool is a changed prefix)."""
    one, other = [tool(1, 100)], [tool(2, 100)]
    assert len(tokenize_tools(one)) == count_tool_tokens(one)
    assert tokenize_tools(one) != tokenize_tools(other)
