"""Relaying an instance's answer to the client, once an attempt has one.

`whole()` passes on a complete answer (non-streamed, or an error) unchanged, its
Content-Encoding included. `first_chunk()` reads a stream until its first data event (the
first token); `stream()` then commits: it sends the headers and copies SSE events as they
arrive. The per-chunk loop hands each read to `sse.Framer`, which passes on whole events
only (so an in-band error never lands inside a half-sent one) and counts them the same
however TCP split them; it parses no JSON. It times only the writes that may block, so a
client that keeps up costs nothing extra.

Failures before the commit raise `Retryable`. After it, a stream the instance breaks,
ends without `data: [DONE]`, or leaves without a data event for longer than the silence
allowed ends with an in-band error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from . import errors, log, splice, sse
from .dispatch import Outcome
from .dispatcher import Dispatcher
from .metrics import Metrics
from .trace_context import TraceContext
from .upstream import AttemptFailed, UpstreamResponse

if TYPE_CHECKING:
    from .tracing import Span

_log = log.get("gateway.proxy")

# Writes that may block (the client is behind, or the chunk is big) are timed; others are
# free. 16 KiB is asyncio's low-water mark.
_BACKLOG = 16 * 1024
_MAX_EVENT = 64 * 1024  # an event longer than this is passed on in pieces, not held

Decode = Callable[[bytes], bytes]


@dataclass
class Exchange:
    """What one request did, for its access-log line and metrics."""

    route: str  # a bounded name: the route's, or "other" for a path no route serves
    request_id: str
    started: float
    tag: str = ""
    model: str = ""  # as a metric label: a model the fleet serves, else "other"
    lane: str = ""
    instance: str = ""
    status: int = 0
    attempts: int = 0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int | None = None
    prompt_tokens: int = 0
    max_tokens: int = 0
    # For the access log only (never labels: unbounded, or chosen by the client).
    method: str = ""
    path: str = ""
    client: str = ""  # the peer address (proxy headers are not trusted)
    user_agent: str = ""
    queue_wait: float = 0.0  # seconds in the gateway queue, all attempts together
    bytes_sent: int = 0
    trace: TraceContext | None = None
    span: Span | None = None  # with OpenTelemetry on: the request's span
    forward: dict[str, str] = field(default_factory=dict)  # client headers the instance gets
    sse_done: bool = True  # its stream, if any, ends with `data: [DONE]`
    bytes_spliced: int = 0  # written below aiohttp (splice.py), so not in its count
    timed: bool = True  # its stream's first event is its first token (see Route.timed)


@dataclass
class Started:
    """A stream whose first data event arrived: its framer, its decoder, the bytes to send."""

    framer: sse.Framer
    decode: Decode | None
    first: bytes


def _stream_decoder(response: UpstreamResponse) -> Decode | None:
    """How to undo the stream's Content-Encoding (None: it has none).

    The gateway never asks for compression, but a stream that comes compressed anyway is
    decoded here rather than passed on encoded: the framer must see the events to pass on
    whole ones, count tokens and append an in-band error, none of which works on gzip bytes.
    """
    encoding = response.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(32 + zlib.MAX_WBITS).decompress  # gzip or zlib header
    raise Retryable(
        "bad_response",
        errors.UpstreamError(
            f"the vLLM instance sent its stream with Content-Encoding {encoding[:40]!r}, "
            "which the gateway cannot decode: expected none, gzip or deflate"
        ),
    )


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
        response: UpstreamResponse,
        ex: Exchange,
        headers: dict[str, str],
        deadline: float,
    ) -> web.Response:
        """Read a whole (non-streamed or error) answer and pass it on unchanged."""
        try:
            data = await response.read(max(0.001, deadline - self.clock()))
        except AttemptFailed as failed:
            if failed.kind == "timeout":
                error: errors.GatewayError = errors.UpstreamTimeout(
                    "the vLLM instance did not finish in time"
                )
            else:
                error = errors.UpstreamError(
                    f"the vLLM instance broke the connection: {failed.detail}"
                )
            raise Retryable(failed.kind, error) from None
        ex.status = response.status
        out_headers = dict(headers)
        out_headers["X-Gateway-Instance"] = ex.instance
        # An encoding the gateway did not ask for goes on with the bytes it describes; the
        # token count is then unknown (the usage object is inside the compressed bytes).
        encoding = response.headers.get("Content-Encoding")
        if encoding:
            out_headers["Content-Encoding"] = encoding
            ex.tokens = None
        else:
            ex.tokens = sse.completion_tokens(data, max(0, len(data) - 512))
        return web.Response(
            status=response.status,
            body=data,
            headers=out_headers,
            content_type=response.content_type or "application/json",
        )

    async def first_chunk(self, response: UpstreamResponse, timeout: float) -> Started:
        """Read until the stream's first data event, within `timeout` (nothing is sent yet).

        Comment events before it (keep-alives) are dropped: passing one on would commit the
        200 before the instance has shown a token, and a retry would no longer be possible.
        """
        decode = _stream_decoder(response)
        framer = sse.Framer(_MAX_EVENT)
        try:
            async with asyncio.timeout(max(0.001, timeout)):
                while True:
                    data = await response.next_chunk()
                    if not data:
                        break
                    first = framer.feed(decode(data) if decode is not None else data)
                    if framer.events:
                        return Started(framer, decode, first)
        except TimeoutError:
            raise Retryable(
                "timeout",
                errors.UpstreamTimeout("the vLLM instance sent no token within the allowance"),
            ) from None
        except AttemptFailed as failed:
            raise Retryable(
                "connect",
                errors.UpstreamError(f"the vLLM instance broke the stream: {failed.detail}"),
            ) from None
        except zlib.error as exc:
            raise Retryable(
                "bad_response",
                errors.UpstreamError(
                    f"the vLLM instance sent a stream that does not decode: {exc}"
                ),
            ) from None
        raise Retryable(
            "bad_response",
            errors.UpstreamError(
                "the vLLM instance ended its 200 answer without a server-sent data event"
                + (f" ({framer.held} bytes that are not one)" if framer.held else "")
            ),
        )

    async def stream(
        self,
        request: web.Request,
        response: UpstreamResponse,
        started: Started,
        ex: Exchange,
        headers: dict[str, str],
        ticket_id: int,
        sent_at: float,
        silence: float,
    ) -> tuple[web.StreamResponse, Outcome, str | None]:
        """Commit: send headers and the first event, then copy events as they arrive.

        `silence` bounds the time between two data events. Only data events reset it:
        comment events (keep-alives) are passed on as they come but cannot hold a stream
        open; the bytes of an unfinished event held when the time is up are dropped, not
        sent half.
        """
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
        # Only a stream whose first event is its first token measures TTFT and teaches
        # least_time a prefill speed; the Responses API's first event comes before any.
        if ex.timed:
            ex.ttft = first_at - ex.started
        self.dispatcher.prefill_done(ticket_id, first_at - sent_at if ex.timed else None)
        transport = request.transport
        if transport is None:  # the client left before we could answer
            return out, self._client_left(ex), None
        framer, decode, chunk = started.framer, started.decode, started.first
        watch = transport.get_protocol()
        if isinstance(response, splice.Source) and isinstance(watch, splice.Watch):
            spliced = await self._splice(out, response, transport, watch, started, ex, silence)
            if isinstance(spliced, tuple):
                return spliced
            return await self._conclude(out, ex, framer, spliced, first_at)
        loop = asyncio.get_running_loop()
        broken: str | None = None  # why the instance's stream is unusable, if it is
        try:
            # One timer for the whole stream, moved on by each data event: cheaper than a
            # timer per read, and the client's own per-read timer (which any byte resets) is off.
            async with asyncio.timeout_at(loop.time() + silence) as quiet:
                while True:
                    if chunk:
                        try:
                            if transport.get_write_buffer_size() + len(chunk) > _BACKLOG:
                                # The client is behind. Give it `timeout.write` seconds, then
                                # let it go rather than keep a GPU generating into a full
                                # buffer. The instance's silence clock stops meanwhile.
                                quiet.reschedule(None)
                                async with asyncio.timeout(self.write_timeout):
                                    await out.write(chunk)
                                quiet.reschedule(loop.time() + silence)
                            else:
                                await out.write(chunk)
                        except (ConnectionResetError, TimeoutError):
                            return out, self._client_left(ex), None
                    try:
                        data = await response.next_chunk()
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if quiet.expired() or not self.aborting or task is None:
                            raise
                        task.uncancel()  # the drain deadline passed: end the stream in-band
                        self.metrics.stream_aborts.labels("shutdown").inc()
                        message = "the gateway is shutting down and its drain time is over"
                        await self._end(out, f"{message}; the answer is incomplete", 503)
                        return await self._finish(out, ex, Outcome.NEUTRAL, "drain_deadline")
                    except AttemptFailed as failed:
                        broken = f"broke the stream after it started ({failed.detail})"
                        break
                    if not data:
                        broken = "ended the stream without " + (
                            "data: [DONE]" if ex.sse_done else "its final event"
                        )
                        break
                    events = framer.events
                    try:
                        chunk = framer.feed(decode(data) if decode is not None else data)
                    except zlib.error:
                        broken = "sent stream bytes that do not decode"
                        break
                    if framer.events != events:
                        quiet.reschedule(loop.time() + silence)
        except TimeoutError:
            broken = f"sent no data event for {silence:g}s"
        return await self._conclude(out, ex, framer, broken, first_at)

    async def _conclude(
        self,
        out: web.StreamResponse,
        ex: Exchange,
        framer: sse.Framer,
        broken: str | None,
        first_at: float,
    ) -> tuple[web.StreamResponse, Outcome, str | None]:
        """End a committed stream: in-band error if it broke, the last chunk, the counts."""
        if framer.done or (not ex.sse_done and sse.responses_finished(framer.last_head)):
            broken = None  # the client has the whole answer: what follows is moot
        ex.tokens = self._stream_tokens(framer, chat=ex.route == "chat.completions")
        if broken is not None:
            self.metrics.stream_aborts.labels("upstream").inc()
            _log.warning("stream_aborted", side="upstream", why=broken, held=framer.held)
            message = f"the vLLM instance {ex.instance} {broken}; the answer is incomplete"
            if not await self._end(out, message, 502, mid_event=framer.mid_event):
                return out, self._client_left(ex), None
            return await self._finish(out, ex, Outcome.FAILURE, "stream_broken")
        result = await self._finish(out, ex, Outcome.SUCCESS, None)
        if result[1] is Outcome.SUCCESS and ex.timed and ex.tokens and ex.tokens > 1:
            ex.tpot = (self.clock() - first_at) / (ex.tokens - 1)
            self.dispatcher.observe_tpot(ex.instance, ex.tpot)
        return result

    async def _splice(
        self,
        out: web.StreamResponse,
        response: splice.Source,
        transport: asyncio.Transport,
        watch: splice.Watch,
        started: Started,
        ex: Exchange,
        silence: float,
    ) -> tuple[web.StreamResponse, Outcome, str | None] | str | None:
        """Relay the rest below the streams (splice.py): why it broke, None, or a result.

        The first event goes through aiohttp, which sends the held response head with it;
        the rest goes from the instance's socket to the client's with no await per chunk.
        """
        try:
            if transport.get_write_buffer_size() + len(started.first) > _BACKLOG:
                async with asyncio.timeout(self.write_timeout):
                    await out.write(started.first)
            else:
                await out.write(started.first)
        except (ConnectionResetError, TimeoutError):
            return out, self._client_left(ex), None
        run = splice.Splice(
            response,
            transport,
            started.framer,
            chunked=out.headers.get("Transfer-Encoding") == "chunked",
            silence=silence,
            write_timeout=self.write_timeout,
            decode=started.decode,
        )
        try:
            run.start(watch)
            end = await run.done
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.aborting or task is None:
                raise  # the client left (the proxy closes the instance's connection now)
            task.uncancel()  # the drain deadline passed: end the stream in-band
            self.metrics.stream_aborts.labels("shutdown").inc()
            message = "the gateway is shutting down and its drain time is over"
            await self._end(out, f"{message}; the answer is incomplete", 503)
            return await self._finish(out, ex, Outcome.NEUTRAL, "drain_deadline")
        finally:
            run.stop(watch)
            ex.bytes_spliced += run.sent
        if end.why is splice.Why.CLIENT:
            return out, self._client_left(ex), None
        if end.why is splice.Why.QUIET:
            return f"sent no data event for {silence:g}s"
        if end.broken is not None:
            return end.broken
        if not started.framer.done:
            return "ended the stream without " + (
                "data: [DONE]" if ex.sse_done else "its final event"
            )
        return None

    async def _end(
        self, out: web.StreamResponse, message: str, code: int, *, mid_event: bool = False
    ) -> bool:
        """Write an in-band error event and [DONE]; False if the client has gone."""
        # An oversized event cut off mid-way is closed first, so the error stands alone.
        event = errors.sse_error_event(message, code)
        try:
            await out.write(b"\n\n" + event if mid_event else event)
        except ConnectionResetError:
            return False
        return True

    async def _finish(
        self, out: web.StreamResponse, ex: Exchange, outcome: Outcome, error: str | None
    ) -> tuple[web.StreamResponse, Outcome, str | None]:
        try:
            await out.write_eof()
        except ConnectionResetError:
            return out, self._client_left(ex), None
        return out, outcome, error

    def _client_left(self, ex: Exchange) -> Outcome:
        ex.status = 499
        self.metrics.stream_aborts.labels("client").inc()
        return Outcome.NEUTRAL

    @staticmethod
    def _stream_tokens(framer: sse.Framer, *, chat: bool) -> int:
        """Output tokens: the usage chunk's count if sent, else one per content event.

        Counted from whole events, so the figure does not depend on how TCP split them.
        """
        usage = framer.completion_tokens()
        if usage is not None:
            return usage
        return max(0, framer.events - framer.done - chat)

    # ------------------------------------------------------------ records
