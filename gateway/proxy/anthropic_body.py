"""An Anthropic Messages body read as the chat request vLLM makes of it.

vLLM serves `/v1/messages` by converting the body to a chat completion request and
rendering that through the chat template (vllm/entrypoints/anthropic/serving.py). The
gateway estimates the prompt, asks an instance's `/tokenize` and compares prefixes on the
same conversion, so one reading of a chat request serves both APIs: `system` (a string or
text blocks, and any system-role message) becomes the first message, joined; a
`tool_use` block an assistant's tool call, its input as JSON arguments; a user's
`tool_result` block a tool message (its images a user message after it); an `image`
block an image part; `thinking` the message's reasoning; `tools` function tools with
their `input_schema` as parameters. Only what reaches the prompt is read; the body sent
to the instance is the client's, unchanged.
"""

from __future__ import annotations

import json
from typing import Any

# Claude Code's first system block: a per-request hash, which vLLM drops so that it does
# not defeat prefix caching (and so must prefix affinity).
_BILLING_HEADER = "x-anthropic-billing-header"


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request (model, messages, tools) vLLM renders for this Messages body."""
    messages: list[dict[str, Any]] = []
    system = _system_text(body)
    if system:
        messages.append({"role": "system", "content": system})
    given = body.get("messages")
    for message in given if isinstance(given, list) else ():
        if isinstance(message, dict) and message.get("role") != "system":
            _add_message(message, messages)
    chat: dict[str, Any] = {"messages": messages}
    if "model" in body:
        chat["model"] = body["model"]
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        chat["tools"] = [_tool(t) for t in tools if isinstance(t, dict)]
    return chat


def _texts(content: Any) -> list[str]:
    """The text blocks of a system prompt, Claude Code's billing header left out."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    return [
        block["text"]
        for block in content
        if isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and not block["text"].startswith(_BILLING_HEADER)
    ]


def _system_text(body: dict[str, Any]) -> str:
    parts = _texts(body.get("system"))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("role") == "system":
            parts += _texts(message.get("content"))
    return "".join(parts)


def _add_message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """Append a user or assistant message, and the tool messages its blocks make first."""
    role = message.get("role")
    chat: dict[str, Any] = {"role": role}
    content = message.get("content")
    if isinstance(content, str):
        chat["content"] = content
        out.append(chat)
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(block))
        elif kind == "tool_result" and role == "user":
            _add_tool_result(block, out)
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        chat["content"] = parts[0]["text"]
    elif parts:
        chat["content"] = parts
    if role != "user" or "content" in chat:  # a user message of tool results alone is none
        out.append(chat)


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.dumps(block.get("input") or {})
    except (RecursionError, TypeError, ValueError):
        arguments = "{}"  # nested past the stack: vLLM refuses the request anyway
    function = {"name": block.get("name") or "", "arguments": arguments}
    return {"id": block.get("id") or "", "type": "function", "function": function}


def _add_tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    images: list[dict[str, Any]] = []
    if isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image" and isinstance(item.get("source"), dict):
                images.append(
                    {"type": "image_url", "image_url": {"url": _image_url(item["source"])}}
                )
        content = "\n".join(texts)
    text = content if isinstance(content, str) else ""
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text})
    if images:
        out.append({"role": "user", "content": images})


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("input_schema"),
    }
    return {"type": "function", "function": function}
