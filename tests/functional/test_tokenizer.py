"""Exact token counts near the long-lane threshold: local tokenizer.json and /tokenize."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from fakes import serving

from gateway.config.schema import PrefillSection, Timeouts
from gateway.proxy.tokenizer import LocalTokenizer, TokenCounter
from gateway.upstream.client import Upstream


def word_tokenizer(folder: Path) -> str:
    """A tokenizer.json that makes one token of each whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


async def test_local_tokenizer_decides_the_lane_near_the_threshold(tmp_path: Path) -> None:
    """Near the threshold the tokenizer's count wins over the bytes/4 estimate."""
    counter = TokenCounter(100, local=LocalTokenizer(word_tokenizer(tmp_path)))
    # 120 one-letter words: about 60 tokens by bytes/4, 120 by the tokenizer.
    assert await counter.count({"prompt": "a " * 120}) == 120
    assert await counter.count({"messages": [{"role": "user", "content": "a " * 120}]}) == 124
    # Far below the threshold the estimate stands, with no tokenizer work.
    assert await counter.count({"prompt": "a"}) == 1


async def test_local_tokenizer_counts_tools_and_images_too(tmp_path: Path) -> None:
    """Near the threshold the exact count keeps the tools' JSON and each image's figure."""
    counter = TokenCounter(100, local=LocalTokenizer(word_tokenizer(tmp_path)))
    tools = [{"name": "a " * 40}]  # JSON text of about 40 words
    image = {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
    content = [{"type": "text", "text": "a a"}, image]
    body = {"messages": [{"role": "user", "content": content}], "tools": tools}
    plain = {"messages": [{"role": "user", "content": "a a"}]}
    costs = PrefillSection(image_tokens=30)
    # Estimated near the threshold, so the tokenizer counts: 4 + 2 words + tools + image.
    total = await counter.count(body, costs)
    assert total == 4 + 2 + LocalTokenizer(word_tokenizer(tmp_path))._json(tools) + 30
    assert total > await counter.count(plain, costs) + 30 + 30


@pytest.fixture
async def tokenize_server() -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    seen: list[dict[str, object]] = []

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if request.headers.get("X-Fail"):
            return web.json_response({"error": "nope"}, status=500)
        return web.json_response({"count": 5000, "max_model_len": 32768, "tokens": []})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    async with serving(app) as url:
        yield url, seen


async def test_instance_tokenize_is_asked_only_near_the_threshold(
    tokenize_server: tuple[str, list[dict[str, object]]],
) -> None:
    """The instance's /tokenize is asked for prompts near the threshold, and only those."""
    url, seen = tokenize_server
    upstream = Upstream(4, Timeouts())
    await upstream.start()
    try:
        counter = TokenCounter(100, upstream=upstream, pick_instance=lambda: (url, {}))
        assert await counter.count({"model": "m", "prompt": "x" * 300}) == 5000
        assert seen == [{"model": "m", "prompt": "x" * 300}]
        assert await counter.count({"prompt": "tiny"}) == 1
        assert len(seen) == 1
        failing = TokenCounter(100, upstream=upstream, pick_instance=lambda: (url, {"X-Fail": "1"}))
        # An instance that cannot count leaves the estimate in place; the request goes on.
        assert await failing.count({"prompt": "x" * 300}) == 75
        nobody = TokenCounter(100, upstream=upstream, pick_instance=lambda: None)
        assert await nobody.count({"prompt": "x" * 300}) == 75
    finally:
        await upstream.close()
