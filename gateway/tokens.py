"""Prompt size in tokens, estimated fast enough for every request.

The estimate is UTF-8 bytes / 4: close for English with BPE vocabularies and, because a
CJK character is 3 bytes, about 0.75 tokens a character for Chinese, near what Qwen- and
Llama-3-style tokenizers give. Token-id prompts are counted exactly. It only has to put a
request in the right lane; it is not billing.
"""

from __future__ import annotations

from typing import Any

PER_MESSAGE = 4  # role markers and separators a chat template adds per message


def estimate_text(text: str) -> int:
    return (len(text.encode("utf-8", "surrogatepass")) + 3) // 4


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return estimate_text(content)
    if isinstance(content, list):  # content parts: count the text ones
        total = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                total += estimate_text(part["text"])
        return total
    return 0


def _single_prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return estimate_text(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)  # token ids
    return 0


def _prompt_tokens(prompt: Any) -> int:
    """A prompt, token ids, or a batch of either (one level deep, as the API allows)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        # A batch: the lane is decided by the largest prompt in it.
        return max(_single_prompt_tokens(p) for p in prompt)
    return _single_prompt_tokens(prompt)


def estimate_request(body: dict[str, Any]) -> int:
    """Tokens of a chat, completion or embedding request body (already parsed JSON)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(
            PER_MESSAGE + _content_tokens(m.get("content")) for m in messages if isinstance(m, dict)
        )
    if "prompt" in body:
        return _prompt_tokens(body["prompt"])
    return _prompt_tokens(body.get("input"))
