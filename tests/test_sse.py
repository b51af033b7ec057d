"""The SSE framer as plain function calls: no sockets, every split of the same stream agrees.

After h11's receive-buffer tests: a stream is fed whole, then split at every byte position,
then in pieces hypothesis picks, and the output and the counts must not change.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.relay.sse import Framer, completion_tokens, finished
from gateway.routes import RESPONSES

ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":16}}\n\n'


def token(i: int) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i


VLLM = ROLE + b"".join(token(i) for i in range(16)) + USAGE + b"data: [DONE]\n\n"


def run(pieces: list[bytes], max_event: int = 64 * 1024) -> tuple[bytes, int, bool, int | None]:
    """Feed the pieces in order: what was passed on and the counts."""
    framer = Framer(max_event)
    out = b"".join(framer.feed(p) for p in pieces)
    return out, framer.events, framer.done, framer.completion_tokens()


def same_events(
    got: tuple[bytes, int, bool, int | None], want: tuple[bytes, int, bool, int | None]
) -> bool:
    """Equal counts and the same events passed on (a trailing extra line end may be held)."""
    return got[0].rstrip(b"\r\n") == want[0].rstrip(b"\r\n") and got[1:] == want[1:]


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(set(cuts)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


def test_a_vllm_stream_counts_each_data_event_and_finds_usage_and_done() -> None:
    """A vLLM stream fed whole: 19 data events, [DONE] seen, usage says 16, bytes unchanged."""
    assert run([VLLM]) == (VLLM, 19, True, 16)


def test_every_two_piece_split_gives_the_same_result() -> None:
    """Split at any byte, the framer passes on the same bytes with the same counts."""
    whole = run([VLLM])
    for cut in range(len(VLLM) + 1):
        assert run([VLLM[:cut], VLLM[cut:]]) == whole, cut


def test_usage_and_done_in_separate_reads_still_find_usage() -> None:
    """The usage chunk is found whether [DONE] arrives with it or in the next read."""
    head = ROLE + token(0)
    assert run([head, USAGE, b"data: [DONE]\n\n"])[1:] == (4, True, 16)
    assert run([head, USAGE + b"data: [DONE]\n\n"])[1:] == (4, True, 16)


def test_only_whole_events_are_passed_on_and_the_rest_is_held() -> None:
    """A read ending mid-event passes on the events before it and holds the rest."""
    framer = Framer()
    assert framer.feed(token(0) + b'data: {"cho') == token(0)
    assert framer.held == len(b'data: {"cho')
    assert framer.feed(b'ices":[]}\n') == b""
    assert framer.feed(b"\n") == b'data: {"choices":[]}\n\n'
    assert (framer.events, framer.held) == (2, 0)


def test_crlf_framing_is_recognised() -> None:
    """Events framed with CRLF line ends are cut and counted like LF ones."""
    crlf = VLLM.replace(b"\n", b"\r\n")
    assert run([crlf]) == (crlf, 19, True, 16)
    for cut in range(len(crlf) + 1):
        assert run([crlf[:cut], crlf[cut:]]) == (crlf, 19, True, 16), cut


def test_comments_are_passed_on_but_not_counted() -> None:
    """Comment events (keep-alives) pass through and count as no data event."""
    stream = b": ping\n\n" + token(0) + b":\n\n: another\r\n\r\n" + b"data: [DONE]\n\n"
    assert run([stream]) == (stream, 2, True, None)
    assert run([b":\n\n"] * 5) == (b":\n\n" * 5, 0, False, None)


def test_an_event_of_several_data_lines_counts_once() -> None:
    """An event of two data lines (and an id line) is one data event."""
    assert run([b"id: 1\ndata: a\ndata: b\n\n"])[1] == 1


def test_a_token_whose_text_is_done_is_not_the_end() -> None:
    """A content event mentioning [DONE] is content; only `data: [DONE]` ends the stream."""
    assert run([b'data: {"text":"data: [DONE]"}\n\n'])[1:3] == (1, False)


def test_no_blank_line_is_not_an_event() -> None:
    """Bytes with no blank line after them are held: not passed on, not counted."""
    framer = Framer()
    assert framer.feed(b"<html>not an event stream</html>\n") == b""
    assert (framer.events, framer.done, framer.held) == (0, False, 33)


def test_an_oversized_event_is_passed_on_in_pieces_and_counted_once() -> None:
    """An event over max_event is passed on as it arrives, counted once; framing resumes."""
    big = b"data: " + b"x" * 300 + b"\n\n"
    stream = token(0) + big + token(1) + b"data: [DONE]\n\n"
    framer = Framer(max_event=64)
    out = b""
    for i in range(0, len(stream), 50):
        out += framer.feed(stream[i : i + 50])
        assert framer.held <= 64 + 3 + 50
    assert out == stream
    assert (framer.events, framer.done, framer.mid_event) == (4, True, False)


LINES = st.sampled_from(
    [
        b"data: {}",
        b"data: [DONE]",
        b"data:[DONE]",
        b'data: {"usage":{"completion_tokens":7}}',
        b"data: " + b"y" * 40,
        b": ping",
        b":",
        b"id: 3",
        b"event: x",
        b"",
        b"junk",
    ]
)
ENDS = st.sampled_from([b"\n", b"\r\n"])


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(st.tuples(LINES, ENDS), max_size=30))
    return b"".join(line + end for line, end in lines) + draw(st.binary(max_size=5))


@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0, max_value=2000)), st.sampled_from([16, 64]))
def test_any_split_gives_the_same_output_and_counts(
    stream: bytes, cuts: list[int], max_event: int
) -> None:
    """For any stream of SSE lines and any split into reads, output and counts are the same."""
    cuts = [c % (len(stream) + 1) for c in cuts]
    got = run(splits(stream, cuts), max_event)
    assert stream.startswith(got[0])
    assert same_events(got, run([stream], max_event))


@settings(max_examples=300, deadline=None)
@given(streams())
def test_byte_by_byte_equals_whole(stream: bytes) -> None:
    """Feeding one byte at a time gives what feeding the stream whole gives."""
    got = run([stream[i : i + 1] for i in range(len(stream))], 16)
    assert same_events(got, run([stream], 16))


PIECES = st.sampled_from([b"\n", b"\r", b"\r\n", b"data:", b"a", b":", b"[DONE]", b"data: [DONE]"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=40).map(b"".join), st.lists(st.integers(0, 400)))
def test_any_split_of_line_end_soup_gives_the_same_counts(stream: bytes, cuts: list[int]) -> None:
    """Even for streams of stray CRs, LFs and fragments, how they are split changes nothing."""
    cuts = [c % (len(stream) + 1) for c in cuts]
    assert same_events(run(splits(stream, cuts), 16), run([stream], 16))


def test_max_event_too_small_to_hold_done_is_refused() -> None:
    """A max_event smaller than a [DONE] event is a programming error, refused at once."""
    with pytest.raises(ValueError, match="at least 16"):
        Framer(8)


@pytest.mark.parametrize("size", [100, 200_000])
def test_the_last_events_head_is_kept_however_long_the_event(size: int) -> None:
    """A Responses stream's final event is recognised even when too long to hold whole."""
    delta = b'event: response.output_text.delta\ndata: {"delta":"x"}\n\n'
    final = b'event: response.completed\ndata: {"response":"' + b"x" * size + b'"}\n\n'
    stream = delta + final
    for step in (7, 4096, len(stream)):
        framer = Framer(64 * 1024)
        out = b"".join(framer.feed(stream[i : i + step]) for i in range(0, len(stream), step))
        assert out == stream
        assert finished(framer.last_head, RESPONSES.end_events)
        assert framer.events == 2


def test_a_responses_usage_counts_its_output_tokens() -> None:
    """The Responses API's usage (`output_tokens`, not `output_tokens_details`) is read."""
    usage = b'{"usage":{"input_tokens":3,"output_tokens_details":{"r":1},"output_tokens":9}}'
    assert completion_tokens(usage) == 9
    framer = Framer()
    framer.feed(b"event: response.completed\ndata: " + usage + b"\n\n")
    assert framer.completion_tokens() == 9


# ------------------------------------------------------------------ Anthropic's named events


def named(kind: str, data: bytes) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), data)


PING = named("ping", b'{"type": "ping"}')
MESSAGE_START = named(
    "message_start",
    b'{"type":"message_start","message":{"id":"m","content":[],"model":"m",'
    b'"usage":{"input_tokens":5,"output_tokens":0}}}',
)
BLOCK_START = named("content_block_start", b'{"type":"content_block_start","index":0}')


def text_delta(i: int) -> bytes:
    return named("content_block_delta", b'{"type":"content_block_delta","text":"t%d"}' % i)


# Usage says 9 output tokens where 3 deltas came: the count must be the usage's.
MESSAGE_DELTA = named(
    "message_delta",
    b'{"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
    b'"usage":{"input_tokens":5,"output_tokens":9}}',
)
MESSAGE_STOP = named("message_stop", b'{"type":"message_stop"}')
ANTHROPIC = (
    PING
    + MESSAGE_START
    + BLOCK_START
    + PING
    + b"".join(text_delta(i) for i in range(3))
    + named("content_block_stop", b'{"type":"content_block_stop","index":0}')
    + MESSAGE_DELTA
    + MESSAGE_STOP
)
MESSAGES_END = ("message_stop", "error")


def run_named(pieces: list[bytes]) -> tuple[bytes, int, int, int | None, bool]:
    """Feed an Anthropic stream: what was passed on, data events, token events, usage, end."""
    framer = Framer(token_event="content_block_delta")
    out = b"".join(framer.feed(p) for p in pieces)
    ended = finished(framer.last_head, MESSAGES_END)
    return out, framer.events, framer.tokens, framer.completion_tokens(), ended


def test_an_anthropic_stream_counts_token_events_and_its_usage_before_message_stop() -> None:
    """Pings are passed on but not counted; 8 data events, 3 of them tokens; the usage of
    `message_delta`, the event before `message_stop`, says 9; `message_stop` ends it."""
    assert run_named([ANTHROPIC]) == (ANTHROPIC, 8, 3, 9, True)


def test_every_split_of_an_anthropic_stream_gives_the_same_counts() -> None:
    """Split at any byte, a named-event stream is passed on and counted the same."""
    whole = run_named([ANTHROPIC])
    for cut in range(len(ANTHROPIC) + 1):
        assert run_named([ANTHROPIC[:cut], ANTHROPIC[cut:]]) == whole, cut


def test_a_stream_with_a_token_event_starts_at_its_first_token() -> None:
    """Named `content_block_delta` as its token, a stream has not started at
    `message_start`; without a token event, its first data event starts it."""
    framer = Framer(token_event="content_block_delta")
    framer.feed(PING + MESSAGE_START + BLOCK_START)
    assert (framer.events, framer.started) == (2, False)
    framer.feed(text_delta(0))
    assert (framer.tokens, framer.started) == (1, True)
    plain = Framer()
    plain.feed(PING)
    assert not plain.started
    plain.feed(MESSAGE_START)
    assert (plain.started, plain.tokens) == (True, 0)


@pytest.mark.parametrize(
    ("head", "ends"),
    [
        (MESSAGE_STOP, True),
        (b"event: error\r\ndata: {}", True),
        (MESSAGE_DELTA, False),
        (b"event: message_stop_later\ndata: {}", False),
        (b'data: {"type":"message_stop"}', False),
    ],
)
def test_a_messages_stream_ends_at_message_stop_or_error(head: bytes, ends: bool) -> None:
    """Only an event named message_stop or error ends an Anthropic stream."""
    assert finished(head, MESSAGES_END) is ends


def hidden_run(pieces: list[bytes]) -> tuple[bytes, int, int | None, int | None]:
    framer = Framer(hide_usage=True)
    out = b"".join(framer.feed(p) for p in pieces)
    return out, framer.events, framer.completion_tokens(), framer.prompt_tokens()


def test_a_usage_chunk_asked_for_by_the_gateway_is_kept_back_however_the_reads_split() -> None:
    """With hide_usage, the client gets the stream less its usage chunk, split anywhere, and
    the counts still come from that chunk."""
    without = VLLM.replace(USAGE, b"")
    assert hidden_run([VLLM]) == (without, 18, 16, 5)
    for cut in range(len(VLLM) + 1):
        assert hidden_run([VLLM[:cut], VLLM[cut:]]) == (without, 18, 16, 5), cut
    assert hidden_run([VLLM[i : i + 1] for i in range(len(VLLM))]) == (without, 18, 16, 5)


def test_only_the_usage_only_chunk_is_kept_back() -> None:
    """A chunk with choices and a usage object (continuous usage stats) passes on."""
    with_choices = b'data: {"choices":[{"delta":{}}],"usage":{"completion_tokens":1}}\n\n'
    stream = ROLE + with_choices + b"data: [DONE]\n\n"
    assert hidden_run([stream])[0] == stream


def test_a_stream_cut_before_its_usage_has_no_usage_counts() -> None:
    """Without the usage chunk (a stream cut short) neither count is invented."""
    framer = Framer(hide_usage=True)
    framer.feed(ROLE + token(0) + token(1))
    assert (framer.completion_tokens(), framer.prompt_tokens(), framer.events) == (None, None, 3)


def test_an_anthropic_prompt_count_comes_from_message_start_when_the_end_lacks_it() -> None:
    """message_start names the input tokens; a stream cut after it still has the count."""
    start = b'event: message_start\ndata: {"message":{"usage":{"input_tokens":42}}}\n\n'
    delta = b'event: content_block_delta\ndata: {"delta":{"text":"a"}}\n\n'
    framer = Framer(token_event="content_block_delta")
    framer.feed(start + delta + delta)
    assert (framer.prompt_tokens(), framer.completion_tokens()) == (42, None)


class Kept:
    """A keeper that records what the framer tells it."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.lost = False

    def add(self, event: bytes) -> None:
        self.events.append(event.strip())

    def lose(self) -> None:
        self.lost = True


def test_a_keeper_is_told_each_whole_data_event_however_reads_split_them() -> None:
    """For migration: every data event passed on (not [DONE], not comments, not the usage
    chunk kept back), whole; an event too long to hold, passed on in pieces, is lost."""
    events = [
        b'data: {"a":1}\n\n',
        b": keep-alive\n\n",
        b'data: {"b":2}\n\n',
        USAGE,
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for cut in range(1, len(stream)):
        kept = Kept()
        framer = Framer(keep=kept, hide_usage=True)
        framer.feed(stream[:cut])
        framer.feed(stream[cut:])
        assert kept.events == [b'data: {"a":1}', b'data: {"b":2}'], cut
        assert not kept.lost
    small = Kept()
    Framer(max_event=16, keep=small).feed(b"data: " + b"x" * 100)
    assert small.lost
