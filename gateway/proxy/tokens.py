"""Prompt size in tokens, estimated fast enough for every request.

Text is UTF-8 bytes / 4: close for English with BPE vocabularies and, because a CJK
character is 3 bytes, about 0.75 tokens a character for Chinese, near what Qwen- and
Llama-3-style tokenizers give. Token-id prompts are counted exactly.

Chat requests carry more than their text. vLLM renders `tools` (and `documents`) into
the prompt through the chat template as JSON, so they count as the text of their JSON;
`response_format` schemas and the legacy `functions` do not reach the prompt (the first
steers decoding, the second vLLM ignores) and are not counted. An image, audio clip or
video part costs what the model's encoder makes of it, which its bytes do not tell. An
inline image whose header gives its size counts its pixels, as dynamic-resolution models
(Qwen2-VL: one token per 28x28 pixels) do; any other media part counts a configured
figure (`[prefill] image_tokens`, ...; see `MediaCosts`).

It only has to put a request in the right lane; it is not billing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.proxy.imagesize import data_url_size

PER_MESSAGE = 4  # role markers and separators a chat template adds per message

# Content part types (or, in a part without "type", its one key) by what they hold, as
# vLLM's chat_utils parses them.
_MEDIA = {
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# Qwen2-VL's default pixel bounds (min_pixels 3,136, max_pixels 12,845,056) in tokens.
IMAGE_MIN_TOKENS = 4
IMAGE_MAX_TOKENS = 16384
# Request fields a chat template renders into the prompt as JSON.
_TEMPLATE_JSON = ("tools", "documents")


class MediaCosts(Protocol):
    """Tokens one image, audio clip or video counts (`[prefill]` carries these)."""

    @property
    def image_tokens(self) -> int: ...
    @property
    def image_pixels_per_token(self) -> int: ...
    @property
    def audio_tokens(self) -> int: ...
    @property
    def video_tokens(self) -> int: ...


@dataclass(frozen=True)
class DefaultMediaCosts:
    """The defaults of `[prefill]`: see README's Dispatch section for where they come from."""

    image_tokens: int = 1500
    image_pixels_per_token: int = 784  # 28 x 28: Qwen2-VL and Qwen2.5-VL
    audio_tokens: int = 750
    video_tokens: int = 8192


DEFAULT_MEDIA = DefaultMediaCosts()


def estimate_text(text: str) -> int:
    return (len(text.encode("utf-8", "surrogatepass")) + 3) // 4


def estimate_json(value: Any) -> int:
    """Tokens of a value rendered as JSON, the way chat templates' `tojson` writes it."""
    try:
        return estimate_text(json.dumps(value, ensure_ascii=False))
    except (RecursionError, ValueError):  # nested past the stack: vLLM refuses it anyway
        return 0


def _media_tokens(part: Mapping[str, Any], media: MediaCosts) -> int:
    kind = part.get("type")
    if not isinstance(kind, str):  # vLLM also takes {"image_url": ...} without a type
        kind = next((key for key in part if key in _MEDIA), "")
    modality = _MEDIA.get(kind)
    if modality == "image":
        return _image_tokens(part.get(kind) or part.get("image_url"), media)
    if modality == "audio":
        return media.audio_tokens
    if modality == "video":
        return media.video_tokens
    return 0


def _image_tokens(image: Any, media: MediaCosts) -> int:
    """An inline image whose header gives its size costs its pixels; any other the figure."""
    url = image.get("url") if isinstance(image, dict) else image
    if media.image_pixels_per_token > 0 and isinstance(url, str):
        size = data_url_size(url)
        if size is not None:
            tokens = -(-size[0] * size[1] // media.image_pixels_per_token)
            return max(IMAGE_MIN_TOKENS, min(tokens, IMAGE_MAX_TOKENS))
    return media.image_tokens


def _content_tokens(content: Any, media: MediaCosts) -> int:
    if isinstance(content, str):
        return estimate_text(content)
    if isinstance(content, list):  # content parts: text, images, audio, video
        total = 0
        for part in content:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            total += estimate_text(text) if isinstance(text, str) else _media_tokens(part, media)
        return total
    return 0


def _message_tokens(message: Any, media: MediaCosts) -> int:
    if not isinstance(message, dict):
        return 0
    tokens = PER_MESSAGE + _content_tokens(message.get("content"), media)
    calls = message.get("tool_calls")  # an assistant's earlier calls, arguments and all
    if calls:
        tokens += estimate_json(calls)
    return tokens


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


def template_json_tokens(body: Mapping[str, Any]) -> int:
    """Tokens of the fields a chat template adds to the prompt as JSON (`tools`, ...)."""
    return sum(estimate_json(body[key]) for key in _TEMPLATE_JSON if body.get(key))


def media_tokens(body: Mapping[str, Any], media: MediaCosts = DEFAULT_MEDIA) -> int:
    """Tokens counted for the image, audio and video parts of a chat request's messages."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            total += sum(
                _media_tokens(part, media)
                for part in content
                if isinstance(part, dict) and not isinstance(part.get("text"), str)
            )
    return total


def _largest(value: Any) -> int:
    """A text or a list of texts (documents, the second texts of score pairs): the largest."""
    if isinstance(value, list):
        return max((_single_prompt_tokens(v) for v in value), default=0)
    return _single_prompt_tokens(value)


def estimate_request(body: dict[str, Any], media: MediaCosts = DEFAULT_MEDIA) -> int:
    """Tokens of the largest prompt in a request body (already parsed JSON).

    Chat, completion, embedding and pooling bodies; the Responses API's `input` items are
    read as messages. A rerank or score request is a batch of (query, document) pairs,
    each its own prompt: the lane is the largest pair's.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(_message_tokens(m, media) for m in messages) + template_json_tokens(body)
    if "prompt" in body:
        return _prompt_tokens(body["prompt"])
    if "query" in body:  # rerank
        return _single_prompt_tokens(body["query"]) + _largest(body.get("documents"))
    if "text_1" in body:  # score
        return _largest(body["text_1"]) + _largest(body.get("text_2"))
    items = body.get("input")
    instructions = body.get("instructions")  # the Responses API's system prompt
    extra = estimate_text(instructions) if isinstance(instructions, str) else 0
    if isinstance(items, list) and items and isinstance(items[0], dict):  # Responses API
        return sum(_message_tokens(m, media) for m in items) + extra + template_json_tokens(body)
    return _prompt_tokens(items) + extra
