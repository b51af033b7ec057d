"""Server-sent events as a byte stream: where events end, and how many carried data.

`Framer.feed(bytes)` takes whatever a read returned and gives back the bytes of the whole
events it completed, holding the unfinished tail for the next read. Its counts (data
events, token events, `[DONE]`, the last data events for the usage) depend only on the
stream, never on how TCP split it: the same bytes fed in any pieces give the same output
and the same counts. No sockets, no JSON; the relay calls it once per read.

The framing is the SSE spec's, for the two line ends servers use: an event ends at a blank
line, LF (`\\n\\n`) or CRLF (`\\r\\n\\r\\n`), mixed as they come. A bare CR as a line end
is not recognised (no server we proxy sends it). An event is a *data event* if one of its
lines starts with `data:`; one of only `:` lines is a comment (a keep-alive), passed on but
not counted. An event longer than `max_event` is passed on in pieces as it arrives rather
than held; it is classified by its first `max_event` bytes, wherever the reads split it.

Named events (an `event: <name>` first line, as vLLM writes the Responses API's and
Anthropic's) are data events too, except Anthropic's keep-alive, `ping`, which is a
comment. A stream whose first events carry no token (Anthropic's `message_start`) names
the event that does (`token_event`): the stream has started at the first of those.

The usage: the last data events (or the one before, for Anthropic's `message_delta`)
carry it, and Anthropic's first (`message_start`) names the prompt's tokens. When the
gateway asked vLLM for a usage chunk the client did not ask for (`hide_usage`), that
chunk (vLLM's `"choices":[]` with a `usage` object, before `data: [DONE]`) is kept from
the client and from the counts: every other byte passes on as it came.
"""

from __future__ import annotations

import re
from typing import Protocol

_DONE_PAYLOADS = (b"data: [DONE]", b"data:[DONE]")
_DONE_EVENTS = (b"data: [DONE]\n\n", b"data:[DONE]\n\n")
_BLANK_LINE = re.compile(rb"\n\r?\n")  # a line end, then an empty line
# The Responses API and Anthropic's call them output tokens.
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
# vLLM's usage-only chunk, as pydantic's compact JSON writes it.
_NO_CHOICES = b'"choices":[]'
_USAGE = b'"usage":{'
_EVENT_LINE = re.compile(rb"event:[ ]?([^\r\n]*)\r?\n")
_KEEP_ALIVE = b"ping"  # Anthropic's keep-alive event, a comment to the framer
_HEAD = 128


class Keeper(Protocol):
    """Takes a stream's data events as they pass (continuation.Transcript)."""

    def add(self, event: bytes) -> None: ...

    def lose(self) -> None:
        """An event went by that could not be read whole."""
        ...


def _last_end(data: bytes, start: int) -> int:
    """The index just past the last blank line in `data[start:]`, or 0 if none."""
    lf = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\n\r\n", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _first_end(data: bytes) -> int:
    """The index just past the first blank line in `data`, or 0 if none."""
    lf = data.find(b"\n\n")
    crlf = data.find(b"\n\r\n")
    if lf < 0:
        return crlf + 3 if crlf >= 0 else 0
    return min(lf + 2, crlf + 3) if crlf >= 0 else lf + 2


def completion_tokens(data: bytes, start: int = 0) -> int | None:
    """The first `completion_tokens` count in `data[start:]` (a usage object), if any."""
    match = _COMPLETION_TOKENS.search(data, start)
    return int(match.group(1)) if match else None


def prompt_tokens(data: bytes, start: int = 0) -> int | None:
    """The first `prompt_tokens` (or `input_tokens`) count in `data[start:]`, if any."""
    match = _PROMPT_TOKENS.search(data, start)
    return int(match.group(1)) if match else None


def usage_only(event: bytes) -> bool:
    """Whether a data event is vLLM's usage chunk: no choices, a usage object."""
    return _NO_CHOICES in event and _USAGE in event


def event_name(head: bytes) -> bytes | None:
    """The name an event's first line gives it (`event: message_stop`), if it names one."""
    match = _EVENT_LINE.match(head)
    return match.group(1) if match else None


def finished(head: bytes, end_events: tuple[str, ...]) -> bool:
    """Whether an event that starts with `head` is one of `end_events`, the named events
    that end a stream without `data: [DONE]` (a route's)."""
    name = event_name(head)
    return name is not None and name.decode("latin-1") in end_events


class Framer:
    """Cuts a byte stream into whole SSE events and counts the data events among them."""

    __slots__ = (
        "_held",
        "_open",
        "_tail",
        "before_last",
        "done",
        "events",
        "first",
        "hide_usage",
        "keep",
        "last",
        "last_head",
        "max_event",
        "token_event",
        "tokens",
        "usage",
    )

    def __init__(
        self,
        max_event: int = 64 * 1024,
        token_event: str = "",
        *,
        hide_usage: bool = False,
        keep: Keeper | None = None,
    ) -> None:
        if max_event < 16:  # [DONE] and the `data:` prefix must fit in an event's head
            raise ValueError(f"max_event must be at least 16 bytes, got {max_event}")
        self.max_event = max_event
        # The name of the events that carry tokens (None: every data event is a token's).
        self.token_event = token_event.encode() if token_event else None
        self.events = 0  # data events passed on, [DONE] included
        self.tokens = 0  # `token_event`s passed on (counted only when there is one)
        self.done = False  # a `data: [DONE]` event was passed on
        self.last = b""  # the last data event other than [DONE]: where a usage chunk is
        self.last_head = b""  # its first bytes, kept even when it is too long to keep
        # The data event before it: Anthropic's usage (`message_delta`) comes just before
        # the event that ends its stream (`message_stop`).
        self.before_last = b""
        self.first = b""  # the first data event (Anthropic's message_start counts the prompt)
        self.hide_usage = hide_usage  # keep vLLM's usage chunk from the client
        self.usage = b""  # that chunk, once kept back
        # With `keep`: told every whole data event passed on (not [DONE], not a usage
        # chunk kept back), for a stream that may be continued elsewhere (continuation.py).
        self.keep = keep
        self._held = b""  # the start of an unfinished event, not passed on yet
        self._open = False  # inside an oversized event whose start was passed on
        self._tail = b""  # the last bytes passed on while `_open`: a blank line may straddle

    @property
    def held(self) -> int:
        """Bytes of an unfinished event not passed on (dropped if the stream ends here)."""
        return len(self._held)

    @property
    def mid_event(self) -> bool:
        """Whether the bytes passed on end inside an event (an oversized one, cut off)."""
        return self._open

    @property
    def started(self) -> bool:
        """Whether the stream's first token has passed: its first data event, or the first
        `token_event` when it names one."""
        return self.tokens > 0 if self.token_event is not None else self.events > 0

    def completion_tokens(self) -> int | None:
        """The usage's `completion_tokens` (or `output_tokens`), if the usage chunk kept
        back, the last data event or the one before it carried one."""
        for event in (self.usage, self.last, self.before_last):
            tokens = completion_tokens(event)
            if tokens is not None:
                return tokens
        return None

    def prompt_tokens(self) -> int | None:
        """The usage's `prompt_tokens` (or `input_tokens`): at the end as for the completion
        tokens, else in the first data event (Anthropic's message_start)."""
        for event in (self.usage, self.last, self.before_last, self.first):
            tokens = prompt_tokens(event)
            if tokens is not None:
                return tokens
        return None

    def feed(self, data: bytes) -> bytes:
        """The bytes of the events `data` completes, ready to pass on whole."""
        if self._open:
            return self._continue(data)
        held = self._held
        if (
            not held
            and data.startswith(b"data:")
            and data.find(b"\n") == len(data) - 2
            and data.endswith(b"\n\n")
            and data[-3] != 13  # CR
        ):
            # The hot path: one read, one single-line LF data event (vLLM sends one a token).
            if data in _DONE_EVENTS:
                self.done = True
            elif self.hide_usage and usage_only(data):
                self.usage = data
                return b""
            else:
                self.before_last = self.last
                self.last = data if len(data) - 2 <= self.max_event else b""
                self.last_head = data[:_HEAD]
                if self.keep is not None:
                    self.keep.add(data)
            self.events += 1
            if self.events == 1:
                self.first = self.last
            return data
        buf = held + data if held else data
        cut = _last_end(buf, max(0, len(held) - 2))
        if cut:
            out, self._held = buf[:cut], buf[cut:]
            hidden = False
            for event in _BLANK_LINE.split(out):
                hidden |= self._classify(event.lstrip(b"\r\n"), whole=True)
            if hidden:
                out = _without_usage(out)
        else:
            out, self._held = b"", buf
        # An event too long to hold is passed on as it comes. Its start is classified once
        # `max_event` bytes of it (after leading line ends, and more than a blank line's
        # worth of bytes that might still be its end) are here, so every split agrees.
        if len(self._held) > self.max_event + 3:
            start = self._held.lstrip(b"\r\n")
            if len(start) > self.max_event + 3 or len(self._held) > 4 * self.max_event:
                out += self._flush_oversized(start)
        return out

    def _classify(self, event: bytes, *, whole: bool) -> bool:
        """Count one event (leading line ends stripped) if it is a data event; True if it
        is the usage chunk to keep back."""
        limit = self.max_event
        head = event if len(event) <= limit else event[:limit]
        if head.startswith(b"data:") or b"\ndata:" in head:
            name = event_name(head)
            if name == _KEEP_ALIVE:
                return False
            if whole and self.hide_usage and usage_only(event):
                self.usage = event
                return True
            self.events += 1
            if name is not None and name == self.token_event:
                self.tokens += 1
            if whole and event.rstrip(b"\r") in _DONE_PAYLOADS:
                self.done = True
            else:
                self.before_last = self.last
                self.last = event if whole and len(event) <= limit else b""
                self.last_head = head[:_HEAD]
                if self.events == 1:
                    self.first = self.last
                if self.keep is not None:
                    if whole:
                        self.keep.add(event)
                    else:
                        self.keep.lose()  # passed on in pieces: not ours to read back
        return False

    def _flush_oversized(self, start: bytes) -> bytes:
        """Pass on the start of an event too long to hold; count it by its first bytes."""
        out, self._held = self._held, b""
        self._classify(start, whole=False)
        self._open, self._tail = True, out[-2:]
        return out

    def _continue(self, data: bytes) -> bytes:
        """Inside an oversized event: pass bytes on until its blank line, then frame again."""
        buf = self._tail + data
        end = _first_end(buf)
        if not end:
            self._tail = buf[-2:]
            return data
        end -= len(self._tail)
        self._open, self._tail = False, b""
        return data[:end] + self.feed(data[end:]) if end < len(data) else data

    def __repr__(self) -> str:
        state = "open" if self._open else f"held={len(self._held)}"
        if self.usage:
            state += " usage_kept_back"
        tokens = "" if self.token_event is None else f" tokens={self.tokens}"
        return f"<Framer events={self.events}{tokens} done={self.done} {state}>"


def _without_usage(out: bytes) -> bytes:
    """Whole events `out` without the usage chunk among them, every other byte as it was."""
    kept, start = [], 0
    for match in _BLANK_LINE.finditer(out):
        event = out[start : match.end()]
        if not usage_only(event):
            kept.append(event)
        start = match.end()
    kept.append(out[start:])
    return b"".join(kept)
