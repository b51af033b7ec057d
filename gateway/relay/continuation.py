"""Request migration: a stream that breaks after the client got part of its answer is
continued on another instance, and the client sees one stream.

Pure functions over bytes and bodies; the proxy (handler.py) decides when, the relay
writes. NVIDIA Dynamo's migration is the model, with vLLM's own way to continue a text:

- **chat completions**: the original messages plus one final `assistant` message holding
  the text already sent, with `continue_final_message: true` and
  `add_generation_prompt: false` (vLLM renders that message open, and the model goes on
  from its last token);
- **completions**: the prompt (a string) plus the text already sent;
- `max_tokens` / `max_completion_tokens` (and `min_tokens`) less the tokens already sent,
  and the usage chunk asked for, so the usage the client sees (if it asked) counts the
  whole answer: the original prompt's tokens (the continuation's, less the text sent,
  which it holds re-tokenized) and the completion tokens of every part.

The continuation's events are rewritten only where they must be: the first part's `id`,
`created` and `model` on every chunk (byte replacements, every other byte as vLLM wrote
it), its role chunk dropped (the client had one), its usage chunk's counts made the whole
answer's (or the chunk kept back, when the client did not ask for it).

What is not migrated (the stream ends with the in-band error, as without migration):
`n` or `best_of` above 1, `logprobs` / `top_logprobs`, `seed` (the continuation cannot
reproduce the sampling), `echo`, guided / structured output (`response_format`,
`guided_*`, `structured_outputs`: Dynamo switched migration off for these because the JSON
came out corrupted), a completions prompt that is not one string, a tool call in flight
(tool-call deltas already sent), and the Messages and Responses APIs (vLLM's Messages
endpoint builds its chat request without `continue_final_message`, so it would start a new
turn; and both streams number each content block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.routes import CHAT, COMPLETIONS, Route

_GUIDED = ("response_format", "structured_outputs", "guided_json", "guided_regex")
_GUIDED_MORE = ("guided_choice", "guided_grammar", "guided_decoding_backend")
COMPACT_EVERY = 8  # events held whole before they are boiled down to their text
_EVENT_END = re.compile(rb"(\r?\n\r?\n)")
_ID = re.compile(rb'"id":\s*"([^"\\]*)"')
_CREATED = re.compile(rb'"created":\s*(\d+)')
_MODEL = re.compile(rb'"model":\s*"((?:[^"\\]|\\.)*)"')
_CONTENT = re.compile(rb'"content":\s*"((?:[^"\\]|\\.)*)"')
_TEXT = re.compile(rb'"text":\s*"((?:[^"\\]|\\.)*)"')
_FINISHED = re.compile(rb'"finish_reason":\s*"')
_TOOL_CALLS = re.compile(rb'"tool_calls":\s*\[\s*\{')
_REASONING = re.compile(rb'"reasoning(?:_content)?":\s*"[^"]')
_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_TOTAL = re.compile(rb'"total_tokens":\s*(\d+)')


def refusal(route: Route, payload: dict[str, Any]) -> str | None:
    """Why a request's stream could not be continued elsewhere, or None if it could."""
    if route.name not in (CHAT.name, COMPLETIONS.name):
        return "route"
    for field in ("n", "best_of"):
        count = payload.get(field)
        if isinstance(count, int) and count > 1:
            return field
    if payload.get("logprobs") or payload.get("top_logprobs"):
        return "logprobs"
    if payload.get("seed") is not None:
        return "seed"
    if payload.get("echo"):
        return "echo"
    if any(payload.get(f) is not None for f in (*_GUIDED, *_GUIDED_MORE)):
        return "structured_output"
    if route.name == COMPLETIONS.name and not isinstance(payload.get("prompt"), str):
        return "prompt"
    if route.name == CHAT.name and not isinstance(payload.get("messages"), list):
        return "messages"
    return None


@dataclass(frozen=True)
class Sent:
    """What a stream's parts gave the client so far."""

    id: bytes
    created: bytes
    model: bytes
    text: str  # the answer's text so far
    tokens: int  # output tokens so far (one per token chunk, as vLLM streams them)
    tool_call: bool = False  # a tool call's deltas went out: not continuable
    reasoning: bool = False  # reasoning went out beside the text: not continuable
    finished: bool = False  # a finish_reason went out: the answer was whole


class Transcript:
    """What a stream sent, kept as it passes (the framer's `Keeper`), as small as a
    continuation can be built from: the first data event (its id, created and model) and
    each token chunk's text as JSON escaped it, a few bytes a token rather than the whole
    ~230-byte event.

    The framer's hot path pays one list append per event: events are kept as they came
    and boiled down `COMPACT_EVERY` at a time (a few regex passes over the block, in C),
    so at most that many whole events are held; nothing is parsed as JSON unless a
    migration reads it (`sent`)."""

    __slots__ = (
        "chat",
        "finished",
        "head",
        "lost",
        "raw",
        "reasoning",
        "text",
        "tokens",
        "tool_call",
    )

    def __init__(self, route: Route) -> None:
        self.chat = route.name == CHAT.name
        self.head = b""
        self.raw: list[bytes] = []  # events not boiled down yet
        self.text = bytearray()  # the token chunks' text, JSON-escaped, end to end
        self.tokens = 0
        self.tool_call = self.reasoning = self.finished = self.lost = False

    def add(self, event: bytes) -> None:
        raw = self.raw
        raw.append(event)
        if len(raw) >= COMPACT_EVERY:
            self._compact()

    def lose(self) -> None:
        self.lost = True

    def _compact(self) -> None:
        raw = self.raw
        if not raw:
            return
        if not self.head:
            self.head = raw[0]
        # Events end at a blank line, and no JSON string holds a raw line end: a match
        # never spans two events.
        block = b"\n\n".join(raw)
        self.raw = []
        found = [p for p in (_CONTENT if self.chat else _TEXT).findall(block) if p]
        self.text += b"".join(found)
        self.tokens += len(found)
        if self.chat:
            self.tool_call = self.tool_call or _TOOL_CALLS.search(block) is not None
            self.reasoning = self.reasoning or _REASONING.search(block) is not None
        self.finished = self.finished or _FINISHED.search(block) is not None

    def sent(self) -> Sent | None:
        """What the stream sent (None: not an answer a continuation can be built on)."""
        self._compact()
        if self.lost or not self.head:
            return None
        found = (_ID.search(self.head), _CREATED.search(self.head), _MODEL.search(self.head))
        if not all(found):
            return None
        id_, created, model = (m.group(1) for m in found if m is not None)
        try:
            text = orjson.loads(b'"' + self.text + b'"')
        except orjson.JSONDecodeError:
            return None
        flags = (self.tool_call, self.reasoning, self.finished)
        return Sent(id_, created, model, text, self.tokens, *flags)

    def __repr__(self) -> str:
        return f"<Transcript tokens={self.tokens} lost={self.lost}>"


def _payload(event: bytes) -> dict[str, Any] | None:
    data = b"".join(
        line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")
    )
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def continuation_body(route: Route, payload: dict[str, Any], sent: Sent) -> dict[str, Any] | None:
    """The request that continues `payload`'s answer after `sent`; None if no token is left."""
    body = dict(payload)
    for field in ("max_tokens", "max_completion_tokens"):
        limit = body.get(field)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - sent.tokens <= 0:
                return None
            body[field] = limit - sent.tokens
    at_least = body.get("min_tokens")
    if isinstance(at_least, int) and not isinstance(at_least, bool):
        body["min_tokens"] = max(0, at_least - sent.tokens)
    if route.name == CHAT.name:
        body["messages"] = [*payload["messages"], {"role": "assistant", "content": sent.text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = payload["prompt"] + sent.text
    body["stream"] = True
    options = body.get("stream_options")
    body["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return body


class Rewriter:
    """A continuation's events as the client sees them: one stream with the first part."""

    def __init__(self, first: Sent, route: Route, *, client_usage: bool, before: int) -> None:
        self.first = first
        self.chat = route.name == CHAT.name
        self.client_usage = client_usage  # the client asked for the usage chunk
        self.before = before  # output tokens the earlier parts sent
        self._seen_first = False

    def feed(self, data: bytes) -> bytes:
        """Whole events (a framer's output), each rewritten."""
        parts = _EVENT_END.split(data)
        # [event, end, event, end, ..., rest]: the ends stay as vLLM wrote them.
        out: list[bytes] = []
        for i in range(0, len(parts) - 1, 2):
            event = self.event(parts[i])
            if event:
                out += (event, parts[i + 1])
        out.append(parts[-1])
        return b"".join(out)

    def event(self, event: bytes) -> bytes:
        """One whole event of the continuation, rewritten (b"": not for the client)."""
        if not event.lstrip().startswith(b"data:") or event.strip() in (
            b"data: [DONE]",
            b"data:[DONE]",
        ):
            return event
        payload = _payload(event)
        if payload is None:
            return event  # not ours to understand: passed on as it came
        first, self._seen_first = not self._seen_first, True
        choices = payload.get("choices")
        if self.chat and first and isinstance(choices, list) and choices:
            delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
            role_only = isinstance(delta, dict) and delta.get("role") and not delta.get("content")
            if role_only and choices[0].get("finish_reason") is None:
                return b""  # the client had its role chunk from the first part
        if choices == [] and isinstance(payload.get("usage"), dict):
            if not self.client_usage:
                return b""
            event = self._usage(event, payload["usage"])
        return self._ids(event)

    def _ids(self, event: bytes) -> bytes:
        sent = self.first
        for pattern, value in ((_ID, sent.id), (_CREATED, sent.created), (_MODEL, sent.model)):
            event = _put(pattern, value, event)
        return event

    def _usage(self, event: bytes, usage: dict[str, Any]) -> bytes:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return event
        # The continuation's prompt holds the text sent so far, re-tokenized.
        original = max(0, prompt - self.before)
        whole = completion + self.before
        event = _put(_PROMPT, str(original).encode(), event)
        event = _put(_COMPLETION, str(whole).encode(), event)
        return _put(_TOTAL, str(original + whole).encode(), event)


def _put(pattern: re.Pattern[bytes], value: bytes, event: bytes) -> bytes:
    """`event` with the first match's group 1 replaced by `value`, every other byte kept."""
    match = pattern.search(event)
    if match is None or match.group(1) == value:
        return event
    return event[: match.start(1)] + value + event[match.end(1) :]
