"""A prompt's token ids as the engine will see them, to look it up in the KV events index.

The index (dispatch/kv_index.py) holds blocks by their token ids, so a request is looked up
by its own. A prompt given as token ids is its own answer. Any other is rendered by an
instance's `/tokenize`, vLLM's own renderer: the chat template, the tools, the generation
prompt and the special tokens, exactly as its chat and completions endpoints render them,
for any model. That costs one small round trip on the control pool, so it is asked only
when it can pay: some instance that may serve the model has a usable index, and the prompt
holds a full block. If no answer comes within `TIMEOUT`, the request goes on without ids
and the inferred index places it, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.dispatch.kv_index import chain
from gateway.proxy.tokens import estimate_request
from gateway.upstream.client import Upstream
from gateway.upstream.response import AttemptFailed

TIMEOUT = 1.0  # seconds; a slower instance is busier than the lookup is worth

# The fields of a chat or completions request that vLLM's /tokenize renders the same way.
_CHAT_FIELDS = (
    "model",
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
)
_COMPLETION_FIELDS = ("model", "prompt", "add_special_tokens")


def given_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids if the request gives them (a completions prompt of ints,
    told by its first as affinity.prompt_text tells it: the instance refuses the rest)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return prompt
    return None


class PromptIds:
    """Token ids and their chain for requests an instance's KV events index can look up."""

    def __init__(
        self,
        upstream: Upstream,
        kv_blocks: Callable[[str | None], tuple[int, str | None] | None],
        pick_instance: Callable[[str | None], tuple[str, dict[str, str]] | None],
    ) -> None:
        self.upstream = upstream
        self.kv_blocks = kv_blocks
        self.pick_instance = pick_instance

    async def chain(
        self, body: dict[str, Any], model: str | None
    ) -> tuple[list[int], tuple[int, ...], int] | None:
        """(token ids, their chain, the block size), or None when no index could use them
        or they cannot be had."""
        blocks = self.kv_blocks(model)
        if blocks is None:
            return None
        block_size, adapter = blocks
        ids = given_ids(body)
        if ids is None:
            if estimate_request(body) < block_size:
                return None  # not one full block: nothing to find cached
            ids = await self._tokenize(body, model)
            if ids is None:
                return None
        salt = body.get("cache_salt")
        hashes = chain(
            ids,
            block_size,
            lora_name=adapter,
            cache_salt=salt if isinstance(salt, str) else None,
        )
        return ids, hashes, block_size

    async def _tokenize(self, body: Mapping[str, Any], model: str | None) -> list[int] | None:
        fields = _CHAT_FIELDS if "messages" in body else _COMPLETION_FIELDS
        query = {k: body[k] for k in fields if k in body}
        if not isinstance(query.get("messages", query.get("prompt")), list | str):
            return None  # a batch of prompts, or none: no one prefix to look up
        picked = self.pick_instance(model)
        if picked is None:
            return None
        url, headers = picked
        try:
            status, data = await self.upstream.fetch(
                url + "/tokenize",
                method="POST",
                body=orjson.dumps(query),
                headers={**headers, "Content-Type": "application/json"},
                timeout=TIMEOUT,
                for_request=True,
            )
            tokens = orjson.loads(data).get("tokens") if status == 200 else None
        except (AttemptFailed, orjson.JSONDecodeError, AttributeError):
            return None
        # Not checked id by id (2k ids cost more than the lookup): ids of another type
        # only fail to match.
        return tokens if isinstance(tokens, list) else None
