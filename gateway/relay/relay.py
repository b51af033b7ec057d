"""Relaying an instance's answer to the client, once an attempt has one.

`whole()` passes on a complete answer (non-streamed, or an error) unchanged, its
Content-Encoding included. `first_chunk()` reads a stream until its first token (its first
data event, or the first of the route's token events), pulling its chunks one by one, with
nothing sent yet (a retry is still possible). `stream()` then commits: a `ClientStream`
(client_stream.py) writes the response head with the events so far, and `splice.Splice`
moves the rest from the instance's socket to the client's, through that same writer, with
flow control both ways and no await per chunk. Both hand each read to
`sse.Framer`, which passes on whole events only (so an in-band error never lands inside a
half-sent one) and counts them the same however TCP split them; it parses no JSON.

Every method returns a value (`relay/records.py`) and writes no one else's state; it
tells the scheduler of the first token and the time per token through the attempt's
`Lease`. After the commit, a stream the instance breaks, ends without `data: [DONE]` (or
the route's final event), or keeps silent longer than allowed ends with an in-band error
event in the route's API's shape (`errors.stream_error`); one cancelled once the drain
time is over ends with an in-band 503 error the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from gateway import errors
from gateway.config.load import Config
from gateway.dispatch import Outcome
from gateway.fleet.dispatcher import Lease
from gateway.observe import log
from gateway.observe.metrics import Metrics
from gateway.relay import splice, sse
from gateway.relay.client_stream import ClientStream
from gateway.relay.continuation import Transcript
from gateway.relay.records import Broken, Started, Streamed, Unusable, Whole, stream_decoder
from gateway.routes import CHAT, Route
from gateway.upstream.response import AttemptFailed, UpstreamResponse


class StreamAnswer(UpstreamResponse, splice.Source, Protocol):
    """A streamed answer as the relay reads it: `Upstream.open`'s (connection.py's
    `Response`), pulled chunk by chunk until the first event, then spliced."""

    async def next_chunk(self, timeout: float | None = None) -> bytes:
        """The body bytes that arrived since the last call, at least one chunk; b"" at the end
        (AttemptFailed if it broke)."""
        ...

    @property
    def fully_read(self) -> bool:
        """The whole body arrived and has been pulled: nothing is left to splice."""
        ...


# Why a stream ended early, as the access line says who cut it.
_CUT_BY = {"stream_broken": "instance", "drain_deadline": "drain"}


class Request(Protocol):
    """What the relay reads of the request it answers (the proxy's `attempt.Call` is one)."""

    @property
    def request(self) -> web.Request: ...

    @property
    def route(self) -> Route: ...

    @property
    def headers(self) -> dict[str, str]: ...


_log = log.get("gateway.proxy")

_MAX_EVENT = 64 * 1024  # an event longer than this is passed on in pieces, not held


def _ended_well(framer: sse.Framer, route: Route) -> bool:
    """The stream's events so far make a whole answer: `data: [DONE]`, or the route's final
    event where it sends no [DONE]."""
    return framer.done or (not route.sse_done and sse.finished(framer.last_head, route.end_events))


class Relay:
    def __init__(
        self,
        metrics: Metrics,
        write_timeout: float,
        clock: Callable[[], float],
        aborting: Callable[[], bool] = lambda: False,
    ) -> None:
        self.metrics = metrics
        self.write_timeout = write_timeout
        self.clock = clock
        self._aborting = aborting  # the lifecycle's: the drain deadline passed

    def apply(self, config: Config) -> None:
        """A (reloaded) configuration: how long a client may stay behind a stream begun
        from now on (`channel.timeout.write`); a stream under way keeps the one it began with."""
        self.write_timeout = config.channel.timeout.write

    @property
    def aborting(self) -> bool:
        """Whether a cancelled stream is ours to end in-band (the drain is over), not a
        client that left; the lifecycle owns the flag, the relay only reads it."""
        return self._aborting()

    async def whole(
        self,
        response: UpstreamResponse,
        instance: str,
        headers: dict[str, str],
        timeout: float,
    ) -> Whole | Unusable:
        """Read a whole (non-streamed or error) answer within `timeout`, to pass on unchanged."""
        try:
            data = await response.read(timeout)
        except AttemptFailed as failed:
            if failed.kind == "timeout":
                return Unusable(
                    "timeout", errors.UpstreamTimeout("the vLLM instance did not finish in time")
                )
            return Unusable(
                failed.reported,
                errors.UpstreamError(f"the vLLM instance broke the connection: {failed.detail}"),
            )
        out_headers = dict(headers)
        out_headers["X-Gateway-Instance"] = instance
        # An encoding the gateway did not ask for goes on with the bytes it describes; the
        # token count is then unknown (the usage object is inside the compressed bytes).
        encoding = response.headers.get("Content-Encoding")
        tokens = prompt = None
        if encoding:
            out_headers["Content-Encoding"] = encoding
        else:  # vLLM writes the usage object last
            tail = max(0, len(data) - 512)
            tokens, prompt = sse.completion_tokens(data, tail), sse.prompt_tokens(data, tail)
        answer = web.Response(
            status=response.status,
            body=data,
            headers=out_headers,
            content_type=response.content_type or "application/json",
        )
        return Whole(answer, tokens, prompt)

    async def first_chunk(
        self,
        response: StreamAnswer,
        timeout: float,
        token_event: str = "",
        *,
        hide_usage: bool = False,
        keep: Transcript | None = None,
    ) -> Started | Unusable:
        """Read until the stream's first token, within `timeout` (nothing is sent yet): its
        first data event, or with `token_event` (the route's) the first of those. With
        `hide_usage` the usage chunk the gateway asked for is kept from the client; `keep`
        is told its data events, for a migration to read back.

        Comment events before the first data event (keep-alives) are dropped: passing one
        on would commit the 200 before the instance has shown a token, and a retry would
        no longer be possible. The data events before a token event are held and sent
        with it. A stream that ends with data events but no token event is passed on whole.
        """
        try:
            decode = stream_decoder(response)
        except ValueError as unknown:
            return Unusable("bad_response", errors.UpstreamError(str(unknown)))
        framer = sse.Framer(_MAX_EVENT, token_event, hide_usage=hide_usage, keep=keep)
        first = b""
        try:
            async with asyncio.timeout(max(0.001, timeout)):
                while True:
                    data = await response.next_chunk()
                    if not data:
                        break
                    held = first if framer.events else b""  # only comments before: dropped
                    first = held + framer.feed(decode(data) if decode is not None else data)
                    if framer.started:
                        return Started(framer, decode, first)
        except TimeoutError:
            return Unusable(
                "timeout",
                errors.UpstreamTimeout("the vLLM instance sent no token within the allowance"),
            )
        except AttemptFailed as failed:
            return Unusable(
                "connect",
                errors.UpstreamError(f"the vLLM instance broke the stream: {failed.detail}"),
            )
        except zlib.error as exc:
            return Unusable(
                "bad_response",
                errors.UpstreamError(
                    f"the vLLM instance sent a stream that does not decode: {exc}"
                ),
            )
        if framer.events:
            return Started(framer, decode, first)
        return Unusable(
            "bad_response",
            errors.UpstreamError(
                "the vLLM instance ended its 200 answer without a server-sent data event"
                + (f" ({framer.held} bytes that are not one)" if framer.held else "")
            ),
        )

    async def stream(
        self,
        call: Request,
        response: StreamAnswer,
        started: Started,
        lease: Lease,
        sent_at: float,
        silence: float,
    ) -> Streamed | Broken:
        """Commit: send headers and the events so far, then splice the rest as it arrives.

        A stream whose events were kept (`first_chunk(keep=...)`) and that its instance
        breaks is returned `Broken`, not ended: the proxy may continue it elsewhere.

        `sent_at` is when the request went out (its TTFT counts from there). `silence`
        bounds the time between two data events. Only data events reset it: comment
        events (keep-alives) are passed on as they come but cannot hold a stream open;
        the bytes of an unfinished event held when the time is up are dropped, not sent
        half.
        """
        route = call.route
        out_headers = dict(call.headers)
        out_headers["X-Gateway-Instance"] = lease.instance
        out_headers["Content-Type"] = response.headers.get("Content-Type", "text/event-stream")
        out_headers["Cache-Control"] = "no-cache"
        out = ClientStream(out_headers, write_timeout=self.write_timeout)
        try:
            await out.prepare(call.request)
        except ConnectionResetError:
            return self._client_left(out)  # nothing of it was sent
        first_at = self.clock()
        # Only a timed route's stream, committed at its first token, measures TTFT and
        # teaches least_time a prefill speed; the Responses API's first event comes before
        # any, and an Anthropic stream may end without a token event.
        timed = route.timed and started.framer.started
        lease.prefill_done(first_at, first_at - sent_at if timed else None)
        broken = await self._splice(out, response, started, silence, route)
        if isinstance(broken, Streamed):
            return broken
        framer = started.framer
        kept = framer.keep
        if broken is not None and isinstance(kept, Transcript) and not _ended_well(framer, route):
            return Broken(out, framer, kept, broken)
        return await self._conclude(call, out, lease, framer, broken, first_at)

    async def resume(
        self,
        call: Request,
        broken: Broken,
        response: StreamAnswer,
        started: Started,
        rewrite: Callable[[bytes], bytes],
        lease: Lease,
        silence: float,
    ) -> Streamed | Broken:
        """Continue `broken`'s answer to the client with another instance's stream (a
        migration's), each event through `rewrite`; what it sends is kept in turn.

        Read and written event by event (through the same `ClientStream`), not spliced: a
        continuation is rare, and its events are rewritten.
        """
        route, out, framer = call.route, broken.response, started.framer
        lease.prefill_done(self.clock(), None)
        why: str | None = None
        data = started.first
        try:
            while True:
                if data:
                    await out.write(rewrite(data))
                if response.fully_read or _ended_well(framer, route):
                    break
                try:
                    chunk = await response.next_chunk(timeout=silence)
                except AttemptFailed as failed:
                    quiet = failed.kind == "timeout"
                    why = f"sent no data event for {silence:g}s" if quiet else failed.detail
                    break
                if not chunk:
                    break
                data = framer.feed(started.decode(chunk) if started.decode else chunk)
        except ConnectionResetError:
            return self._client_left(out, framer, route)
        if why is None and not _ended_well(framer, route):
            done = "data: [DONE]" if route.sse_done else "its final event"
            why = "ended the stream without " + done
        if why is not None:
            kept = framer.keep if isinstance(framer.keep, Transcript) else Transcript(route)
            return Broken(out, framer, kept, why)
        return await self._finish(out, Outcome.SUCCESS, None, framer, route)

    async def end(self, call: Request, broken: Broken, instance: str) -> Streamed:
        """End a broken stream no migration continues: the in-band error, the last chunk."""
        route, framer = call.route, broken.framer
        self.metrics.stream_aborts.labels("upstream").inc()
        _log.warning("stream_aborted", side="upstream", why=broken.why, held=framer.held)
        message = f"the vLLM instance {instance} {broken.why}; the answer is incomplete"
        if not await self._end(broken.response, route, message, 502, mid_event=framer.mid_event):
            return self._client_left(broken.response, framer, route)
        return await self._finish(broken.response, Outcome.FAILURE, "stream_broken", framer, route)

    async def _conclude(
        self,
        call: Request,
        out: ClientStream,
        lease: Lease,
        framer: sse.Framer,
        broken: str | None,
        first_at: float,
    ) -> Streamed:
        """End a committed stream: in-band error if it broke, the last chunk, the counts."""
        route = call.route
        if _ended_well(framer, route):
            broken = None  # the client has the whole answer: what follows is moot
        if broken is not None:
            self.metrics.stream_aborts.labels("upstream").inc()
            _log.warning("stream_aborted", side="upstream", why=broken, held=framer.held)
            message = f"the vLLM instance {lease.instance} {broken}; the answer is incomplete"
            if not await self._end(out, route, message, 502, mid_event=framer.mid_event):
                return self._client_left(out, framer, route)
            return await self._finish(out, Outcome.FAILURE, "stream_broken", framer, route)
        result = await self._finish(out, Outcome.SUCCESS, None, framer, route)
        tokens = result.tokens
        if result.outcome is Outcome.SUCCESS and route.timed and tokens and tokens > 1:
            tpot = (self.clock() - first_at) / (tokens - 1)
            lease.observe_tpot(tpot)
            return dataclasses.replace(result, tpot=tpot)
        return result

    async def _splice(
        self,
        out: ClientStream,
        response: StreamAnswer,
        started: Started,
        silence: float,
        route: Route,
    ) -> Streamed | str | None:
        """Relay the rest below the streams (splice.py): why it broke, None, or a record.

        The first event goes out with the response head in one write; the rest goes from
        the instance's socket to the client's with no await per chunk.
        """
        # The whole answer came with its first token (one burst): head, events and the last
        # chunk go out in one write, with nothing left to splice.
        whole = response.fully_read and _ended_well(started.framer, route)
        try:
            await (out.end if whole else out.write)(started.first)
        except ConnectionResetError:  # gone, or behind for write_timeout
            return self._client_left(out, started.framer, route)
        if whole:
            return None
        run = splice.Splice(
            response,
            out,
            started.framer,
            silence=silence,
            write_timeout=self.write_timeout,
            decode=started.decode,
        )
        try:
            run.start(out)
            end = await run.done
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None:
                raise
            # Answered, not raised: what was relayed is counted and logged either way (the
            # proxy closes the instance's connection once the attempt returns).
            task.uncancel()
            if not self.aborting:
                return self._client_left(out, started.framer, route)  # aiohttp saw it go
            self.metrics.stream_aborts.labels("shutdown").inc()  # the drain deadline passed
            message = "the gateway is shutting down and its drain time is over"
            await self._end(out, route, f"{message}; the answer is incomplete", 503)
            return await self._finish(out, Outcome.NEUTRAL, "drain_deadline", started.framer, route)
        finally:
            run.stop(out)
        if end.why is splice.Why.CLIENT:
            return self._client_left(out, started.framer, route)
        if end.why is splice.Why.QUIET:
            return f"sent no data event for {silence:g}s"
        if end.broken is not None:
            return end.broken
        if not started.framer.done:
            done = "data: [DONE]" if route.sse_done else "its final event"
            return "ended the stream without " + done
        return None

    async def _end(
        self,
        out: ClientStream,
        route: Route,
        message: str,
        code: int,
        *,
        mid_event: bool = False,
    ) -> bool:
        """Write an in-band error in the route's shape; False if the client has gone."""
        # An oversized event cut off mid-way is closed first, so the error stands alone.
        event = errors.stream_error(message, code, route.api)
        try:
            await out.write(b"\n\n" + event if mid_event else event)
        except ConnectionResetError:
            return False
        return True

    async def _finish(
        self,
        out: ClientStream,
        outcome: Outcome,
        error: str | None,
        framer: sse.Framer,
        route: Route,
    ) -> Streamed:
        try:
            await out.end()
        except ConnectionResetError:
            return self._client_left(out, framer, route)
        tokens = self._stream_tokens(framer, chat=route.name == CHAT.name)
        cut = _CUT_BY.get(error or "")
        return Streamed(out, 200, outcome, error, tokens, None, cut, framer.prompt_tokens())

    def _client_left(
        self, out: ClientStream, framer: sse.Framer | None = None, route: Route = CHAT
    ) -> Streamed:
        """The client is gone: a 499 with what was relayed to it (nothing, without a framer)."""
        out.cut()
        self.metrics.stream_aborts.labels("client").inc()
        if framer is None:
            return Streamed(out, 499, Outcome.NEUTRAL, None, 0, cut="client")
        tokens = self._stream_tokens(framer, chat=route.name == CHAT.name)
        prompt = framer.prompt_tokens()
        return Streamed(out, 499, Outcome.NEUTRAL, None, tokens, None, "client", prompt)

    @staticmethod
    def _stream_tokens(framer: sse.Framer, *, chat: bool) -> int:
        """Output tokens: the usage's count if sent, else one per token event (one per data
        event but [DONE] and chat's role chunk, where every data event is a token's).

        Counted from whole events, so the figure does not depend on how TCP split them.
        """
        usage = framer.completion_tokens()
        if usage is not None:
            return usage
        if framer.token_event is not None:
            return framer.tokens
        return max(0, framer.events - framer.done - chat)

    def __repr__(self) -> str:
        return f"<Relay write_timeout={self.write_timeout:g} aborting={self.aborting}>"
