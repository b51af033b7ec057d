"""What the relay returns: values the proxy reads, so only the proxy writes the Exchange;
and how a stream's Content-Encoding is undone before it is framed.

Before the commit an answer is `Whole` (pass it on as it is), `Started` (a stream whose
first data event arrived) or `Unusable` (why, and the error for the client); a committed
stream ends in `Streamed`, or `Broken` while migration may still continue it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from gateway import errors
from gateway.dispatch import Outcome
from gateway.relay import sse
from gateway.relay.client_stream import ClientStream
from gateway.relay.continuation import Transcript
from gateway.upstream.response import UpstreamResponse

Decode = Callable[[bytes], bytes]


@dataclass(frozen=True)
class Unusable:
    """An answer that cannot be passed on (nothing of it was sent): why, and our error."""

    reason: str  # "connect", "timeout" or "bad_response", as `AttemptFailed.reported`
    error: errors.GatewayError


@dataclass(frozen=True)
class Whole:
    """A complete answer, ready to pass on, and its usage's counts when readable."""

    response: web.Response
    tokens: int | None
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class Started:
    """A stream whose first data event arrived: its framer, its decoder, the bytes to send."""

    framer: sse.Framer
    decode: Decode | None
    first: bytes


@dataclass(frozen=True)
class Streamed:
    """What relaying a committed stream did, for the proxy to record."""

    response: web.StreamResponse
    status: int  # 200, or 499 when the client left
    outcome: Outcome  # what it says about the instance
    error: str | None  # why it ended badly, for the instance's record
    tokens: int | None = None  # output tokens: the usage's, else those relayed
    tpot: float | None = None  # seconds per output token after the first, when measured
    cut: str | None = None  # who cut it short: client, drain or instance (None: it ended)
    prompt_tokens: int | None = None  # the usage's (None: the stream carried none)


@dataclass(frozen=True)
class Broken:
    """A committed stream its instance broke, not yet ended for the client: the proxy may
    continue it on another instance (continuation.py), else it ends it (`Relay.end`)."""

    response: ClientStream
    framer: sse.Framer
    transcript: Transcript  # what it sent the client
    why: str  # what the instance did, for the in-band error and the instance's record

    @property
    def reason(self) -> str:
        """`why` as a label: the instance went quiet, ended the stream, or reset it."""
        if self.why.startswith("sent no data event"):
            return "timeout"
        return "eof" if self.why.startswith("ended the stream") else "reset"


def stream_decoder(response: UpstreamResponse) -> Decode | None:
    """How to undo the stream's Content-Encoding (None: it has none).

    The gateway never asks for compression, but a stream that comes compressed anyway is
    decoded here rather than passed on encoded: the framer must see the events to pass on
    whole ones, count tokens and append an in-band error, none of which works on gzip bytes.
    Raises ValueError, with the message for the client, for an encoding it cannot undo.
    """
    encoding = response.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(32 + zlib.MAX_WBITS).decompress  # gzip or zlib header
    raise ValueError(
        f"the vLLM instance sent its stream with Content-Encoding {encoding[:40]!r}, "
        "which the gateway cannot decode: expected none, gzip or deflate"
    )
