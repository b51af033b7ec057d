"""Relaying an instance's answer to the client, once an attempt has one.

`whole()` passes on a complete answer (non-streamed, or an error) unchanged. `stream()`
commits: it sends the headers and then copies SSE events as they arrive. Its per-chunk
loop copies bytes and counts `data:` markers; it parses no JSON. It passes on whole events
only, so an in-band error never lands inside a half-sent one, and it times only the writes
that may block, so a client that keeps up costs nothing extra.

Failures before the commit raise `Retryable`; after it, the stream ends with an in-band
error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from . import errors, log
from .dispatch import Outcome
from .dispatcher import Dispatcher
from .metrics import Metrics

_log = log.get("gateway.proxy")

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_DATA = b"data:"
_DONE = b"data: [DONE]"
# Writes that may block (the client is behind, or the chunk is big) are timed; others are
# free. 16 KiB is asyncio's low-water mark.
_BACKLOG = 16 * 1024
_MAX_PARTIAL = 64 * 1024  # a "partial event" longer than this is passed on anyway


@dataclass
class Exchange:
    """What one request did, for its access-log line and metrics."""

    route: str
    request_id: str
    started: float
    tag: str = ""
    lane: str = ""
    instance: str = ""
    status: int = 0
    attempts: int = 0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int | None = None
    prompt_tokens: int = 0
    max_tokens: int = 0


def _event_boundary(data: bytes) -> int:
    """The index just past the last complete SSE event in `data` (0 if none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class Retryable(Exception):
    """An attempt failed before anything reached the client: `error` is what to answer."""

    def __init__(self, reason: str, error: errors.GatewayError | web.Response) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class Relay:
    def __init__(
        self,
        metrics: Metrics,
        dispatcher: Dispatcher,
        write_timeout: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.metrics = metrics
        self.dispatcher = dispatcher
        self.write_timeout = write_timeout
        self.clock = clock or dispatcher.clock
        self.aborting = False  # set when the drain deadline passed: end streams in-band

    async def whole(
        self,
        response: aiohttp.ClientResponse,
        ex: Exchange,
        headers: dict[str, str],
        deadline: float,
    ) -> web.Response:
        """Read a whole (non-streamed or error) answer and pass it on unchanged."""
        try:
            async with asyncio.timeout(max(0.001, deadline - self.clock())):
                data = await response.read()
        except TimeoutError:
            raise Retryable(
                "timeout", errors.UpstreamTimeout("the vLLM instance did not finish in time")
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Retryable(
                "connect", errors.UpstreamError(f"the vLLM instance broke the connection: {exc}")
            ) from None
        ex.status = response.status
        match = _COMPLETION_TOKENS.search(data, max(0, len(data) - 512))
        ex.tokens = int(match.group(1)) if match else None
        out_headers = dict(headers)
        out_headers["X-Gateway-Instance"] = ex.instance
        return web.Response(
            status=response.status,
            body=data,
            headers=out_headers,
            content_type=response.content_type or "application/json",
        )

    async def first_chunk(self, response: aiohttp.ClientResponse, timeout: float) -> bytes:
        try:
            async with asyncio.timeout(max(0.001, timeout)):
                first = await response.content.readany()
        except TimeoutError:
            raise Retryable(
                "timeout",
                errors.UpstreamTimeout("the vLLM instance sent no token within the allowance"),
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Retryable(
                "connect", errors.UpstreamError(f"the vLLM instance broke the stream: {exc}")
            ) from None
        if not first:
            raise Retryable(
                "connect", errors.UpstreamError("the vLLM instance closed the stream empty")
            )
        return first

    async def stream(
        self,
        request: web.Request,
        response: aiohttp.ClientResponse,
        first: bytes,
        ex: Exchange,
        headers: dict[str, str],
        ticket_id: int,
        sent_at: float,
    ) -> tuple[web.StreamResponse, Outcome, str | None]:
        """Commit: send headers and the first chunk, then copy chunks as they arrive."""
        out_headers = dict(headers)
        out_headers["X-Gateway-Instance"] = ex.instance
        out_headers["Content-Type"] = response.headers.get("Content-Type", "text/event-stream")
        out_headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(status=200, headers=out_headers)
        ex.status = 200
        try:
            await out.prepare(request)
        except ConnectionResetError:
            return out, self._client_left(ex), None
        first_at = self.clock()
        ex.ttft = first_at - ex.started
        self.dispatcher.prefill_done(ticket_id, first_at - sent_at)
        reader = response.content
        transport = request.transport
        if transport is None:  # the client left before we could answer
            return out, self._client_left(ex), None
        outcome: Outcome = Outcome.SUCCESS
        error: str | None = None
        events, last, pending, chunk = 0, b"", b"", first
        while True:
            # Pass on whole SSE events only, so an error event can never be glued to a
            # half-sent one. vLLM sends whole events per chunk, so this rarely holds back.
            if pending:
                chunk, pending = pending + chunk, b""
            if not chunk.endswith(b"\n\n"):  # rare: split mid-event, or CRLF framing
                cut = _event_boundary(chunk)
                if cut < len(chunk) and len(chunk) - cut < _MAX_PARTIAL:
                    chunk, pending = chunk[:cut], chunk[cut:]
            if chunk:
                try:
                    if transport.get_write_buffer_size() + len(chunk) > _BACKLOG:
                        # The client is behind. Give it `timeout.write` seconds, then let
                        # it go rather than keep a GPU generating into a full buffer.
                        async with asyncio.timeout(self.write_timeout):
                            await out.write(chunk)
                    else:
                        await out.write(chunk)
                except (ConnectionResetError, TimeoutError):
                    return out, self._client_left(ex), None
                events += chunk.count(_DATA)
                last = chunk
            try:
                chunk = await reader.readany()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self.aborting or task is None:
                    raise
                task.uncancel()  # the drain deadline passed: end the stream in-band
                outcome, error = Outcome.NEUTRAL, "drain_deadline"
                self.metrics.stream_aborts.labels("shutdown").inc()
                message = "the gateway is shutting down and its drain time is over"
                await out.write(errors.sse_error_event(f"{message}; the answer is incomplete", 503))
                break
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                outcome, error = Outcome.FAILURE, "stream_broken"
                self.metrics.stream_aborts.labels("upstream").inc()
                _log.warning("stream_aborted", side="upstream", error=type(exc).__name__)
                await out.write(
                    errors.sse_error_event(
                        f"the vLLM instance {ex.instance} broke the stream after it started "
                        f"({type(exc).__name__}); the answer is incomplete"
                    )
                )
                break
            if not chunk:
                if pending:  # the instance ended without a final blank line: pass it on
                    await out.write(pending)
                break
        try:
            await out.write_eof()
        except ConnectionResetError:
            return out, self._client_left(ex), None
        ex.tokens = self._stream_tokens(events, last, chat=ex.route == "chat.completions")
        if outcome is Outcome.SUCCESS and ex.tokens and ex.tokens > 1:
            ex.tpot = (self.clock() - first_at) / (ex.tokens - 1)
            self.metrics.tpot.labels(ex.lane).observe(ex.tpot)
            self.dispatcher.observe_tpot(ex.instance, ex.tpot)
        return out, outcome, error

    def _client_left(self, ex: Exchange) -> Outcome:
        ex.status = 499
        self.metrics.stream_aborts.labels("client").inc()
        return Outcome.NEUTRAL

    @staticmethod
    def _stream_tokens(events: int, last: bytes, *, chat: bool) -> int:
        """Output tokens: the usage chunk's count if sent, else one per content event."""
        match = _COMPLETION_TOKENS.search(last)
        if match:
            return int(match.group(1))
        overhead = (1 if _DONE in last else 0) + (1 if chat else 0)
        return max(0, events - overhead)

    # ------------------------------------------------------------ records
