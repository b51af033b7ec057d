"""Exact prompt counts where they matter: near the long-lane threshold.

The fast estimate (`tokens.estimate_request`) decides every request whose estimate is
far from the threshold. Within a factor of two of it, a configured tokenizer gives the
exact count: a local HuggingFace `tokenizer.json`, or the `/tokenize` endpoint of an
instance (one small round trip, only for those requests). If the exact count cannot be
had, the estimate stands: lane choice must never fail a request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gateway.config.load import Config
from gateway.proxy.tokens import (
    DEFAULT_MEDIA,
    PER_MESSAGE,
    MediaCosts,
    estimate_request,
    media_tokens,
)
from gateway.upstream.client import Upstream
from gateway.upstream.response import AttemptFailed

_TOKENIZE_TIMEOUT = 1.0


class LocalTokenizer:
    """Counts with a HuggingFace tokenizer.json (the `tokenizers` package)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)

    def _text(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, body: dict[str, Any], media: MediaCosts = DEFAULT_MEDIA) -> int | None:
        messages = body.get("messages")
        if isinstance(messages, list):
            total = 0
            for message in messages:
                if not isinstance(message, dict):
                    continue
                content = message.get("content")
                if isinstance(content, list):
                    content = " ".join(
                        p["text"]
                        for p in content
                        if isinstance(p, dict) and isinstance(p.get("text"), str)
                    )
                total += PER_MESSAGE + (self._text(content) if isinstance(content, str) else 0)
                if message.get("tool_calls"):
                    total += self._json(message["tool_calls"])
            extras = [body[key] for key in ("tools", "documents") if body.get(key)]
            return total + sum(self._json(e) for e in extras) + media_tokens(body, media)
        prompt = body.get("prompt", body.get("input"))
        if isinstance(prompt, str):
            return self._text(prompt)
        return None  # token ids and batches: the estimate is already exact or close

    def _json(self, value: Any) -> int:
        try:
            return self._text(json.dumps(value, ensure_ascii=False))
        except (RecursionError, ValueError):
            return 0


class TokenCounter:
    def __init__(
        self,
        threshold: int,
        *,
        local: LocalTokenizer | None = None,
        upstream: Upstream | None = None,
        pick_instance: Callable[[], tuple[str, dict[str, str]] | None] | None = None,
    ) -> None:
        self.threshold = threshold
        self.local = local
        self.upstream = upstream
        self.pick_instance = pick_instance

    def apply(self, config: Config) -> None:
        """A (reloaded) configuration: the long-lane threshold, near which an exact count is
        worth asking for (the tokenizer itself is fixed at start)."""
        self.threshold = config.prefill.long_input_threshold

    @property
    def exact(self) -> bool:
        return self.local is not None or self.upstream is not None

    async def count(self, body: dict[str, Any], media: MediaCosts = DEFAULT_MEDIA) -> int:
        estimate = estimate_request(body, media)
        if not self.exact or not self.threshold / 2 < estimate < self.threshold * 2:
            return estimate
        if self.local is not None:
            exact = self.local.count(body, media)
        else:
            exact = await self._ask_instance(body)
        return estimate if exact is None else exact

    async def _ask_instance(self, body: dict[str, Any]) -> int | None:
        picked = self.pick_instance() if self.pick_instance else None
        if picked is None or self.upstream is None:
            return None
        url, headers = picked
        # vLLM's /tokenize renders tools and images as a chat request would: the count is whole.
        query = {k: body[k] for k in ("model", "messages", "prompt", "tools") if k in body}
        if "messages" not in query and "prompt" not in query:
            return None
        try:
            status, data = await self.upstream.fetch(
                url + "/tokenize",
                method="POST",
                body=json.dumps(query).encode(),
                headers=headers,
                timeout=_TOKENIZE_TIMEOUT,
                for_request=True,
            )
            count = json.loads(data).get("count") if status == 200 else None
        except (AttemptFailed, ValueError, AttributeError):
            return None
        return count if isinstance(count, int) else None
