"""An Anthropic Messages body read as the chat request vLLM converts it to: what the
estimate, /tokenize and prefix affinity see of a request on /v1/messages."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gateway.dispatch.affinity import prompt_blocks, prompt_text
from gateway.proxy.anthropic_body import as_chat
from gateway.proxy.tokens import estimate_request

TOOL = {
    "name": "Read",
    "description": "Reads a file.",
    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
}


def claude_code(billing: str = "cch=1f2e3d") -> dict[str, Any]:
    """A Claude Code style body: system blocks (the billing header first), a tool, a turn of
    tool_use and tool_result."""
    return {
        "model": "m",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0; {billing};"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "x"}},
        ],
        "tools": [TOOL],
        "messages": [
            {"role": "user", "content": "What is in main.py?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read it.", "signature": "s"},
                    {"type": "text", "text": "Let me read it."},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"}],
            },
        ],
    }


def test_a_claude_code_body_reads_as_vllms_chat_request() -> None:
    """The system blocks become one system message without the billing header; tool_use an
    assistant tool call; the user's tool_result a tool message; tools function tools."""
    chat = as_chat(claude_code())
    assert chat["model"] == "m"
    assert chat["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "What is in main.py?"},
        {
            "role": "assistant",
            "reasoning": "I should read it.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "Read", "arguments": json.dumps({"file_path": "a"})},
                }
            ],
            "content": "Let me read it.",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "print(1)"},
    ]
    function = chat["tools"][0]["function"]
    assert (function["name"], function["parameters"]) == ("Read", TOOL["input_schema"])


def test_system_as_a_string_and_system_messages_join_in_one_system_message() -> None:
    """`system` as a string, then any system-role message, make the first message."""
    body = {
        "system": "Be brief. ",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Use French."}]},
            {"role": "user", "content": "hi"},
        ],
    }
    assert as_chat(body)["messages"] == [
        {"role": "system", "content": "Be brief. Use French."},
        {"role": "user", "content": "hi"},
    ]


def test_images_become_image_parts_and_tool_result_images_follow_their_tool_message() -> None:
    """An image block is an image part (base64 as a data URL); a tool result's images come
    as a user message after its tool message, as vLLM orders them."""
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://x/a.jpg"}},
                    {"type": "text", "text": "and this:"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [
                            {"type": "text", "text": "shot"},
                            {"type": "image", "source": png},
                        ],
                    },
                ],
            }
        ]
    }
    tool, after, message = as_chat(body)["messages"]
    assert tool == {"role": "tool", "tool_call_id": "t", "content": "shot"}
    assert after["content"][0]["image_url"]["url"] == "data:image/png;base64,iVBORw0KGgo="
    assert message["content"][0] == {"type": "image_url", "image_url": {"url": "https://x/a.jpg"}}


def test_the_estimate_counts_what_reaches_the_prompt() -> None:
    """System, tools and the tool turn all count: a body's estimate is its chat reading's,
    well above the estimate of its messages' text alone."""
    body = claude_code()
    body["system"][1]["text"] = "You are Claude Code. " * 500  # about 2,600 tokens
    estimate = estimate_request(as_chat(body))
    assert estimate > 2_600
    assert estimate > estimate_request(as_chat({**body, "tools": []}))
    assert estimate_request(body) < 100  # read as a chat body, the system prompt is missed


def test_the_billing_header_does_not_break_prefix_affinity() -> None:
    """Two Claude Code requests that differ only in the billing header's per-request hash
    have the same prompt as vLLM sees it, the system prompt first."""
    a, b = as_chat(claude_code("cch=aaaaaa")), as_chat(claude_code("cch=bbbbbb"))
    assert prompt_text(a) == prompt_text(b)
    assert prompt_text(a).startswith(b"system\nYou are Claude Code.")
    assert prompt_blocks(prompt_text(a)) == prompt_blocks(prompt_text(b))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "x"])},
    optional={k: json_values for k in ("text", "source", "input", "content", "thinking", "id")},
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "system": json_values | st.lists(blocks, max_size=3),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "system", 3])},
                optional={"content": json_values | st.lists(blocks, max_size=4)},
            )
            | json_values,
            max_size=4,
        ),
        "tools": json_values
        | st.lists(st.dictionaries(st.text(max_size=8), json_values), max_size=2),
    },
)


@given(bodies)
def test_any_body_reads_without_raising(body: dict[str, Any]) -> None:
    """Whatever the client sent, the reading and its estimate never raise (vLLM refuses
    what does not validate; the gateway only has to place it)."""
    assert estimate_request(as_chat(body)) >= 0
