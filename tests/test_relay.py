"""The relay against scripted upstream answers and a fake client transport: no sockets.

Each test replays what an instance sends (`fake_upstream.FakeResponse`, which splices as
connection.py's answer does), runs one relay step, and checks the value it returns and,
for a committed stream, the bytes the client got. The same behaviours are also checked
end to end, through real loopback servers, in `functional/test_upstream_misbehaves.py`
and `functional/test_faults_upstream.py`.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from fake_upstream import FakeResponse, FakeUpstream, Pause
from prometheus_client import CollectorRegistry

from gateway import errors
from gateway.dispatch import Lane, Outcome
from gateway.observe.metrics import Metrics
from gateway.proxy.attempt import Call
from gateway.relay.records import Started, Streamed, Unusable, Whole
from gateway.relay.relay import Relay
from gateway.routes import CHAT, MESSAGES, RESPONSES
from gateway.upstream.response import AttemptFailed

SSE = {"Content-Type": "text/event-stream"}
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}\n\n'
DONE = b"data: [DONE]\n\n"


def token(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"t%d "}}]}\n\n' % i


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeLease:
    """What the relay tells the scheduler through the attempt's lease."""

    instance: str = "a"
    prefills: list[tuple[float, float | None]] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)

    def prefill_done(self, at: float, ttft: float | None) -> None:
        self.prefills.append((at, ttft))

    def observe_tpot(self, seconds: float) -> None:
        self.tpots.append(seconds)


def relay(clock: Clock | None = None) -> Relay:
    return Relay(Metrics(CollectorRegistry()), write_timeout=5.0, clock=clock or Clock())


class Client(asyncio.Transport):
    """The client's transport: keeps what each write carried of the body, unframed (the
    relay's `ClientStream` writes the head, each event and the last chunk through it), and
    the head apart.

    With `leaves_after`, the client is gone once it holds that many writes (0: at once):
    the transport says it is closing. Each write moves `clock` (if given) on by `tick`
    seconds.
    """

    def __init__(self, leaves_after: int | None, clock: Clock | None, tick: float) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.heads: list[bytes] = []
        self.ended = False  # the last chunk came
        self.leaves_after = leaves_after
        self.clock, self.tick = clock, tick
        self.listener: Callable[[bool], None] | None = None
        self.behind = False  # the write buffer is over its high-water mark

    @property
    def gone(self) -> bool:
        return self.leaves_after is not None and len(self.sent) >= self.leaves_after

    def write(self, data: bytes | bytearray | memoryview) -> None:
        rest = bytes(data)
        assert not self.ended, "written after the last chunk"
        if rest.startswith(b"HTTP/"):
            assert not self.heads, "a second head"
            head, rest = rest.split(b"\r\n\r\n", 1)
            self.heads.append(head)
        assert self.heads, "the body before the head"
        body = b""
        while rest:  # whole HTTP/1.1 chunks only
            size, rest = rest.split(b"\r\n", 1)
            n = int(size, 16)
            assert rest[n : n + 2] == b"\r\n", data
            body, rest = body + rest[:n], rest[n + 2 :]
            self.ended = n == 0
        self.sent.append(body)
        if self.clock is not None:
            self.clock.now += self.tick

    def is_closing(self) -> bool:
        return self.gone

    def get_write_buffer_size(self) -> int:
        return 0

    def get_protocol(self) -> Client:  # type: ignore[override]
        return self  # the client connection's protocol reports its buffer (splice.Watch)

    def watch_writing(self, listener: Callable[[bool], None] | None) -> bool:
        self.listener = listener
        return self.behind


def client(
    *, leaves_after: int | None = None, clock: Clock | None = None, tick: float = 0.0
) -> tuple[web.Request, Client]:
    """A mocked client request on a fake client transport, whose `sent` gets the body."""
    transport = Client(leaves_after, clock, tick)
    request = make_mocked_request("POST", "/v1/chat/completions", transport=transport)
    return request, transport


def call_of(request: web.Request, route: Any = CHAT) -> Call:
    return Call(request, route, b"{}", True, Lane.SHORT, 1e9, {"X-Request-ID": "r1"})


def aborts(r: Relay, side: str) -> float:
    value: float = r.metrics.stream_aborts.labels(side)._value.get()
    return value


async def relay_stream(
    items: list[Any],
    *,
    leaves_after: int | None = None,
    route: Any = CHAT,
    silence: float = 5.0,
    **headers: str,
) -> tuple[Streamed, bytes, FakeLease, Relay]:
    """Read the first event, then commit and relay the rest; what the client got."""
    r = relay()
    response = FakeResponse(200, items, {**SSE, **headers})
    started = await r.first_chunk(response, timeout=5.0, token_event=route.token_event)
    assert isinstance(started, Started), started
    request, got = client(leaves_after=leaves_after)
    lease = FakeLease()
    try:
        record = await r.stream(
            call_of(request, route), response, started, lease, 99.0, silence=silence
        )
    finally:
        response.close()  # as the proxy does
    return record, b"".join(got.sent), lease, r


def events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


# ------------------------------------------------------------------ whole answers


async def test_a_whole_answer_passes_on_with_its_status_type_and_token_count() -> None:
    """Status, content type and body go on unchanged; the usage count is read from it."""
    body = json.dumps({"choices": [], "usage": {"completion_tokens": 12}}).encode()
    response = FakeResponse(200, [body[:10], body[10:]], {"Content-Type": "application/json"})
    whole = await relay().whole(response, "a", {"X-Request-ID": "r1"}, timeout=1.0)
    assert isinstance(whole, Whole)
    assert whole.tokens == 12
    assert whole.response.status == 200
    assert whole.response.body == body
    assert whole.response.content_type == "application/json"
    assert whole.response.headers["X-Gateway-Instance"] == "a"
    assert whole.response.headers["X-Request-ID"] == "r1"


async def test_a_compressed_whole_answer_keeps_its_encoding_and_counts_nothing() -> None:
    """An encoded answer goes on with its Content-Encoding; its tokens are unknown."""
    body = gzip.compress(b'{"usage":{"completion_tokens":3}}')
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    whole = await relay().whole(FakeResponse(200, [body], headers), "a", {}, timeout=1.0)
    assert isinstance(whole, Whole)
    assert whole.tokens is None
    assert whole.response.headers["Content-Encoding"] == "gzip"
    assert whole.response.body == body


@pytest.mark.parametrize(
    ("item", "reason", "error"),
    [
        (AttemptFailed("connect", "ClientPayloadError: cut"), "connect", errors.UpstreamError),
        (Pause(1.0), "timeout", errors.UpstreamTimeout),
    ],
)
async def test_a_whole_answer_that_breaks_or_stalls_is_unusable(
    item: Any, reason: str, error: type[errors.GatewayError]
) -> None:
    """A body cut off is a connect failure (502); one slower than its time, a timeout (504)."""
    response = FakeResponse(503, [b'{"error":', item, b"}"])
    got = await relay().whole(response, "a", {}, timeout=0.05)
    assert isinstance(got, Unusable)
    assert got.reason == reason
    assert type(got.error) is error


# ------------------------------------------------------------------ before the commit


async def test_comments_before_the_first_data_event_are_dropped() -> None:
    """Keep-alive comments before the first token are not sent; the first event is whole."""
    first = token(0)
    response = FakeResponse(200, [b": ping\n\n", b": ping\n\n" + first[:9], first[9:]], SSE)
    started = await relay().first_chunk(response, timeout=1.0)
    assert isinstance(started, Started)
    assert started.first == first
    assert started.framer.events == 1


async def test_an_answer_without_a_data_event_is_a_bad_response() -> None:
    """A 200 that ends before any data event is unusable, naming the bytes it held."""
    response = FakeResponse(200, [b'{"not": "an event stream"}'], SSE)
    got = await relay().first_chunk(response, timeout=1.0)
    assert isinstance(got, Unusable)
    assert got.reason == "bad_response"
    assert "26 bytes that are not one" in got.error.message


async def test_no_token_within_the_allowance_is_a_timeout() -> None:
    """Comments alone do not count: no data event within the allowance is a timeout."""
    response = FakeResponse(200, [b": ping\n\n", Pause(1.0), token(0)], SSE)
    got = await relay().first_chunk(response, timeout=0.05)
    assert isinstance(got, Unusable)
    assert (got.reason, type(got.error)) == ("timeout", errors.UpstreamTimeout)


async def test_a_stream_broken_before_its_first_token_is_a_connect_failure() -> None:
    """A connection that breaks before the first event is retryable as "connect"."""
    response = FakeResponse(200, [b": ping\n\n", AttemptFailed("connect", "reset")], SSE)
    got = await relay().first_chunk(response, timeout=1.0)
    assert isinstance(got, Unusable)
    assert got.reason == "connect"
    assert "reset" in got.error.message


async def test_an_unknown_stream_encoding_is_a_bad_response_before_any_read() -> None:
    """A stream in an encoding the framer cannot read is refused without reading it."""
    response = FakeResponse(200, [token(0)], {**SSE, "Content-Encoding": "br"})
    got = await relay().first_chunk(response, timeout=1.0)
    assert isinstance(got, Unusable)
    assert got.reason == "bad_response"
    assert "'br'" in got.error.message
    assert response.reads == 0


# ------------------------------------------------------------------ the committed stream


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
async def test_events_reach_the_client_whole_however_the_reads_split_them(size: int) -> None:
    """Split into reads of any size, the client gets the same whole events and count."""
    wire = b"".join(token(i) for i in range(5)) + USAGE + DONE
    reads = [wire[i : i + size] for i in range(0, len(wire), size)]
    record, body, lease, _ = await relay_stream(reads)
    assert body == wire
    assert events(body) == events(wire)
    assert (record.status, record.outcome, record.error) == (200, Outcome.SUCCESS, None)
    assert record.tokens == 7  # from the usage chunk
    sent_headers = record.response.headers
    assert (sent_headers["X-Gateway-Instance"], sent_headers["X-Request-ID"]) == ("a", "r1")
    assert lease.prefills == [(100.0, 1.0)]  # first token at 100, sent at 99


async def test_a_stream_that_arrives_whole_goes_out_in_one_write_with_its_end() -> None:
    """A stream whose every event came with its first token is sent in one write that ends
    the answer (nothing is left to splice); one that came whole but without [DONE] is not,
    so its in-band error can follow."""
    wire = b"".join(token(i) for i in range(5)) + USAGE + DONE
    record, body, _, _ = await relay_stream([wire])
    assert body == wire
    assert (record.status, record.outcome, record.tokens) == (200, Outcome.SUCCESS, 7)
    request, got = client()
    r = relay()
    response = FakeResponse(200, [wire], SSE)
    started = await r.first_chunk(response, timeout=5.0)
    assert isinstance(started, Started)
    await r.stream(call_of(request), response, started, FakeLease(), 99.0, silence=5.0)
    assert got.sent == [wire]  # one write, with the end
    assert response._pusher is None  # never spliced
    record, body, _, _ = await relay_stream([token(0) + token(1)])
    assert events(body)[-1] == DONE
    assert record.error == "stream_broken"


async def test_a_stream_without_done_ends_with_one_in_band_error_event() -> None:
    """An instance that stops without [DONE] leaves the client an error event, then [DONE]."""
    record, body, _, r = await relay_stream([token(0), token(1)])
    sent = events(body)
    assert sent[:2] == [token(0), token(1)]
    assert sent[-1] == DONE
    error = json.loads(sent[-2].removeprefix(b"data: "))["error"]
    assert "ended the stream without data: [DONE]" in error["message"]
    assert (record.status, record.outcome, record.error) == (200, Outcome.FAILURE, "stream_broken")
    assert aborts(r, "upstream") == 1


async def test_a_break_in_the_middle_of_an_event_closes_it_before_the_error() -> None:
    """Broken mid-event, the held half is not sent and the error event stands alone."""
    half = token(1)[:20]
    record, body, _, _ = await relay_stream(
        [token(0), half, AttemptFailed("connect", "ClientPayloadError: cut")]
    )
    assert b"t1 " not in body  # whole events only: the held half is dropped
    assert body.startswith(token(0) + b'data: {"error"')
    assert body.endswith(DONE)
    assert b"broke the stream after it started (ClientPayloadError: cut)" in body
    assert record.outcome is Outcome.FAILURE


async def test_a_responses_stream_ends_at_its_final_event_without_done() -> None:
    """A Responses API stream is whole at `response.completed`, with no [DONE] to wait for."""
    created = b'event: response.created\ndata: {"type":"response.created"}\n\n'
    done = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
    record, body, lease, _ = await relay_stream([created, done], route=RESPONSES)
    assert body == created + done
    assert (record.status, record.outcome) == (200, Outcome.SUCCESS)
    assert lease.prefills == [(100.0, None)]  # its first event is no token: nothing learned


async def test_a_client_that_leaves_mid_stream_is_a_499_that_says_nothing_of_the_instance() -> None:
    """A write to a gone client ends the relay: 499, a neutral outcome, counted once."""
    record, body, _, r = await relay_stream([token(0), token(1), token(2), DONE], leaves_after=1)
    assert body == token(0)
    assert (record.status, record.outcome, record.error) == (499, Outcome.NEUTRAL, None)
    assert aborts(r, "client") == 1
    assert aborts(r, "upstream") == 0


async def test_a_client_that_stays_behind_pauses_the_instance_and_is_let_go() -> None:
    """A client over its buffer mark stops the instance's reads; behind for longer than
    `write_timeout`, it is let go as a 499."""
    r = relay()
    r.write_timeout = 0.05
    response = FakeResponse(200, [token(0), token(1), DONE], SSE)
    started = await r.first_chunk(response, timeout=1.0)
    assert isinstance(started, Started)
    request, got = client()
    got.behind = True
    record = await r.stream(call_of(request), response, started, FakeLease(), 99.0, silence=5.0)
    response.close()
    assert b"".join(got.sent) == token(0)  # the first event, sent with the head
    assert response.pauses == 1
    assert (record.status, record.outcome) == (499, Outcome.NEUTRAL)
    assert aborts(r, "client") == 1


async def test_a_stream_silent_for_longer_than_allowed_ends_in_band() -> None:
    """No data event for `silence` seconds ends the stream with an error event and [DONE]."""
    record, body, _, r = await relay_stream([token(0), Pause(1.0), DONE], silence=0.05)
    assert body.startswith(token(0) + b'data: {"error"')
    assert b"sent no data event for 0.05s" in body
    assert body.endswith(DONE)
    assert (record.status, record.outcome, record.error) == (200, Outcome.FAILURE, "stream_broken")
    assert aborts(r, "upstream") == 1


async def test_a_timed_stream_reports_its_time_per_token_through_the_lease() -> None:
    """A chat stream that ends well tells the lease its time per output token."""
    clock = Clock()
    r = relay(clock)
    response = FakeResponse(200, [token(0), token(1), token(2), DONE], SSE)
    started = await r.first_chunk(response, timeout=1.0)
    assert isinstance(started, Started)
    request, _ = client(clock=clock, tick=0.5)  # each write takes half a second
    lease = FakeLease()
    record = await r.stream(call_of(request), response, started, lease, 99.0, silence=5.0)
    assert record.tokens == 2  # three content events, less the role-only first one
    assert record.tpot == lease.tpots[0] > 0


# ------------------------------------------------------------------ Anthropic's Messages stream


def named(kind: str, data: bytes = b"{}") -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), data)


PING = named("ping")
MESSAGE_START = named("message_start", b'{"type":"message_start","message":{"content":[]}}')
BLOCK_START = named("content_block_start")
BLOCK_STOP = named("content_block_stop")
MESSAGE_STOP = named("message_stop")


def delta(i: int) -> bytes:
    return named("content_block_delta", b'{"delta":{"type":"text_delta","text":"t%d"}}' % i)


def message_delta(output_tokens: int) -> bytes:
    return named(
        "message_delta", b'{"usage":{"input_tokens":4,"output_tokens":%d}}' % output_tokens
    )


async def test_an_anthropic_stream_is_held_until_its_first_token() -> None:
    """message_start and the block's start are no token: nothing commits, and the first
    token's allowance runs on, until a content_block_delta; then they go out together,
    without the ping that came before any of them."""
    events: list[Any] = [PING, MESSAGE_START, PING, BLOCK_START, Pause(1.0), delta(0)]
    late = await relay().first_chunk(
        FakeResponse(200, events, SSE), timeout=0.05, token_event=MESSAGES.token_event
    )
    assert isinstance(late, Unusable)
    assert late.reason == "timeout"
    events = [PING, MESSAGE_START, PING, BLOCK_START, delta(0), delta(1)]
    started = await relay().first_chunk(
        FakeResponse(200, events, SSE), timeout=1.0, token_event=MESSAGES.token_event
    )
    assert isinstance(started, Started)
    assert started.first == MESSAGE_START + PING + BLOCK_START + delta(0)
    assert (started.framer.events, started.framer.tokens) == (3, 1)


async def test_an_anthropic_stream_counts_the_usage_of_message_delta_and_ends_at_message_stop() -> (
    None
):
    """A whole Messages stream: every event passes on, its first token teaches the lease a
    TTFT, its output tokens are message_delta's usage (not the count of deltas), and
    message_stop ends it with nothing added."""
    wire = [MESSAGE_START, BLOCK_START, delta(0), delta(1), BLOCK_STOP, message_delta(5)]
    record, body, lease, _ = await relay_stream([*wire, MESSAGE_STOP], route=MESSAGES)
    assert body == b"".join(wire) + MESSAGE_STOP
    assert (record.status, record.outcome, record.error) == (200, Outcome.SUCCESS, None)
    assert record.tokens == 5
    assert lease.prefills == [(100.0, 1.0)]  # committed at the first token, sent at 99


async def test_a_broken_anthropic_stream_ends_with_an_anthropic_error_event() -> None:
    """A Messages stream cut before message_stop ends with an `error` event in Anthropic's
    shape (api_error) and no [DONE]; its tokens are its deltas, no usage having come."""
    record, body, _, r = await relay_stream(
        [MESSAGE_START, BLOCK_START, delta(0), delta(1)], route=MESSAGES
    )
    sent = events(body)
    assert sent[:4] == [MESSAGE_START, BLOCK_START, delta(0), delta(1)]
    name, data = sent[-1].removesuffix(b"\n\n").split(b"\n")
    assert name == b"event: error"
    error = json.loads(data.removeprefix(b"data: "))
    assert error["type"] == "error"
    assert error["error"]["type"] == "api_error"
    assert "ended the stream without its final event" in error["error"]["message"]
    assert b"[DONE]" not in body
    assert (record.outcome, record.error, record.tokens) == (Outcome.FAILURE, "stream_broken", 2)
    assert aborts(r, "upstream") == 1


async def test_an_anthropic_stream_without_a_token_passes_on_whole_and_teaches_nothing() -> None:
    """A Messages stream that ends without a content_block_delta (nothing generated) is
    still the client's answer: passed on whole; no TTFT is learned from it."""
    wire = [MESSAGE_START, message_delta(0), MESSAGE_STOP]
    record, body, lease, _ = await relay_stream(wire, route=MESSAGES)
    assert body == b"".join(wire)
    assert (record.outcome, record.tokens) == (Outcome.SUCCESS, 0)
    assert [ttft for _, ttft in lease.prefills] == [None]


async def test_the_fake_upstream_replays_answers_in_order_and_keeps_what_was_sent() -> None:
    """The fake answers each open with the next script and records the request."""
    upstream = FakeUpstream(AttemptFailed("connect", "refused"), FakeResponse(200, [b"ok"]))
    with pytest.raises(AttemptFailed):
        await upstream.open("POST", "http://a/v1/x", body=b"{}", headers={}, timeout=1.0)
    assert await upstream.fetch("http://b/health", timeout=1.0) == (200, b"ok")
    assert [s.url for s in upstream.sent] == ["http://a/v1/x", "http://b/health"]
