"""The long-lane estimate: text, token ids, images and other media, tools as JSON text."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.schema import PrefillSection
from gateway.proxy.tokens import (
    DEFAULT_MEDIA,
    PER_MESSAGE,
    estimate_json,
    estimate_request,
    estimate_text,
    media_tokens,
)


@dataclass(frozen=True)
class Costs:
    image_tokens: int = 1000
    image_pixels_per_token: int = 784
    audio_tokens: int = 300
    video_tokens: int = 7000


COSTS = Costs()
BIG_IMAGE = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * 600_000).decode()


def chat(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}], **fields}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(url: str = BIG_IMAGE) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def schema(size: int) -> list[dict[str, Any]]:
    """One tool whose JSON schema is about `size` bytes."""
    props = {f"field_{i}": {"type": "string", "description": "d" * 40} for i in range(size // 80)}
    params = {"type": "object", "properties": props}
    return [{"type": "function", "function": {"name": "lookup", "parameters": params}}]


def test_each_image_counts_the_configured_figure_whatever_its_bytes() -> None:
    """An image part costs image_tokens, not its base64 length / 4 and not nothing."""
    one = estimate_request(chat(text("look"), image()), COSTS)
    assert one == PER_MESSAGE + 1 + COSTS.image_tokens
    tiny = estimate_request(chat(text("look"), image("https://example.com/a.png")), COSTS)
    assert tiny == one
    two = estimate_request(chat(text("look"), image(), image()), COSTS)
    assert two == one + COSTS.image_tokens


@pytest.mark.parametrize(
    ("part", "cost"),
    [
        ({"type": "image_url", "image_url": {"url": "https://x/y.jpg"}}, 1000),
        ({"type": "input_image", "image_url": "https://x/y.jpg"}, 1000),
        ({"type": "image_embeds", "image_embeds": "AAAA"}, 1000),
        ({"image_url": "https://x/y.jpg"}, 1000),  # vLLM's shorthand without "type"
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, 300),
        ({"type": "audio_url", "audio_url": {"url": "https://x/a.mp3"}}, 300),
        ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, 7000),
        ({"type": "refusal_or_unknown", "x": 1}, 0),
    ],
)
def test_media_parts_count_by_modality(part: dict[str, Any], cost: int) -> None:
    """Images, audio and video are known by part type (or shorthand key), as vLLM parses them."""
    assert estimate_request(chat(part), COSTS) == PER_MESSAGE + cost
    assert media_tokens(chat(part), COSTS) == cost


def test_defaults_come_from_the_prefill_section() -> None:
    """[prefill]'s defaults are the estimate's defaults, and its fields are the figures used."""
    section = PrefillSection()
    assert (section.image_tokens, section.audio_tokens, section.video_tokens) == (
        DEFAULT_MEDIA.image_tokens,
        DEFAULT_MEDIA.audio_tokens,
        DEFAULT_MEDIA.video_tokens,
    )
    custom = PrefillSection(image_tokens=7)
    assert estimate_request(chat(image()), custom) == PER_MESSAGE + 7


def test_tools_count_as_the_text_of_their_json() -> None:
    """A 40 KB tool schema counts about 10,000 tokens: its JSON bytes / 4."""
    tools = schema(40_000)
    size = len(json.dumps(tools))
    assert size > 38_000
    body = chat(text("hi"), tools=tools)
    assert estimate_request(body) == PER_MESSAGE + 1 + estimate_text(json.dumps(tools))
    assert estimate_request(body) > 9_000


def test_earlier_tool_calls_and_documents_count_too() -> None:
    """An assistant's tool_calls and `documents` reach the prompt, so they count."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x" * 4000}}]
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}
    assert estimate_request(body) == PER_MESSAGE + estimate_json(calls)
    docs = [{"title": "a", "text": "y" * 8000}]
    assert estimate_request({"messages": [], "documents": docs}) == estimate_json(docs)


def test_response_format_and_legacy_functions_are_not_counted() -> None:
    """A response_format schema steers decoding and vLLM ignores `functions`: neither counts."""
    plain = chat(text("hi"))
    big = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(20_000)[0]}}
    assert estimate_request({**plain, "response_format": big}) == estimate_request(plain)
    assert estimate_request({**plain, "functions": schema(20_000)}) == estimate_request(plain)


def test_deeply_nested_tools_do_not_raise() -> None:
    """Tools nested as deep as json.loads allows are estimated without raising."""
    import sys

    depth = sys.getrecursionlimit() - 50
    body = json.loads('{"messages": [], "tools": ' + "[" * depth + "]" * depth + "}")
    assert estimate_request(body) >= 0


parts = st.lists(
    st.builds(text, st.text(max_size=30))
    | st.builds(image, st.text(max_size=30))
    | st.fixed_dictionaries({"type": st.sampled_from(["video_url", "input_audio", "x"])}),
    max_size=5,
)


@given(parts, parts)
def test_more_parts_never_estimate_fewer_tokens(first: list[Any], more: list[Any]) -> None:
    """Adding content parts, media or text, never lowers the estimate."""
    assert estimate_request(chat(*first, *more), COSTS) >= estimate_request(chat(*first), COSTS)


@given(parts, st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=20)), max_size=3))
def test_tools_add_exactly_their_json_estimate(content: list[Any], tools: list[Any]) -> None:
    """Tools add their JSON's bytes / 4 to whatever the messages count."""
    body = chat(*content)
    expected = estimate_request(body, COSTS) + (estimate_json(tools) if tools else 0)
    assert estimate_request({**body, "tools": tools}, COSTS) == expected


def png_url(width: int, height: int) -> str:
    """A data URL whose PNG header says width x height (the pixels themselves are not read)."""
    header = (
        b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR" + width.to_bytes(4, "big") + height.to_bytes(4, "big")
    )
    return "data:image/png;base64," + base64.b64encode(header + b"\0" * 600).decode()


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (3000, 2000, 7654),  # 6 MP photo: 6,000,000 / 784, rounded up
        (1024, 1024, 1338),
        (10, 10, 4),  # below Qwen2-VL's min_pixels: its 4 tokens
        (60000, 60000, 16384),  # beyond its max_pixels: its 16,384
    ],
)
def test_inline_image_costs_its_pixels(width: int, height: int, tokens: int) -> None:
    """An inline image whose header gives its size costs one token per 784 pixels, bounded."""
    assert media_tokens(chat(image(png_url(width, height))), COSTS) == tokens


def test_pixel_costing_can_be_turned_off() -> None:
    """With image_pixels_per_token = 0 every image counts image_tokens."""
    flat = Costs(image_pixels_per_token=0)
    assert media_tokens(chat(image(png_url(3000, 2000))), flat) == flat.image_tokens
    assert (
        media_tokens(chat(image(png_url(3000, 2000))), Costs(image_pixels_per_token=1000)) == 6000
    )


def test_a_responses_request_counts_its_input_items_and_instructions() -> None:
    """The Responses API's input items count like messages, its instructions like text."""
    body = {
        "instructions": "b" * 400,
        "input": [
            {"role": "user", "content": "a" * 4000},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "c" * 40}],
            },
        ],
    }
    assert estimate_request(body) == 100 + (PER_MESSAGE + 1000) + (PER_MESSAGE + 10)
    assert estimate_request({"input": "a" * 4000, "instructions": "b" * 400}) == 1100


def test_rerank_and_score_count_their_largest_pair() -> None:
    """Each (query, document) pair is its own prompt: the lane is the largest pair's."""
    rerank = {"query": "q" * 400, "documents": ["d" * 40, "d" * 40000, "d" * 4]}
    assert estimate_request(rerank) == 100 + 10000
    score = {"text_1": "q" * 400, "text_2": ["d" * 40, "d" * 4000]}
    assert estimate_request(score) == 100 + 1000
    assert estimate_request({"text_1": ["q" * 4, "q" * 40], "text_2": "d" * 4}) == 10 + 1
