"""W3C trace context: which client traceparents are continued, and what the instance gets."""

from __future__ import annotations

import pytest

from gateway.observe import trace_context
from gateway.relay.sse import finished
from gateway.routes import RESPONSES

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_is_continued_with_its_tracestate() -> None:
    """The client's trace id, parent and flags are kept; tracestate travels beside them."""
    ctx = trace_context.from_headers({"traceparent": GOOD, "tracestate": "k=v"})
    assert ctx is not None
    assert ctx.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert ctx.traceparent() == GOOD
    assert ctx.state == "k=v"
    assert ctx.sampled


def test_the_next_hop_can_hang_under_another_parent() -> None:
    """traceparent(parent_id) keeps the trace and flags and swaps the parent span."""
    ctx = trace_context.from_headers({"traceparent": GOOD})
    assert ctx is not None
    assert ctx.traceparent("aaaaaaaaaaaaaaaa") == GOOD.replace("00f067aa0ba902b7", "a" * 16)


def test_a_later_version_is_read_by_its_first_fields_and_sent_as_00() -> None:
    """Version 01 with an extra field is continued as version 00, per the spec."""
    ctx = trace_context.from_headers({"traceparent": "01" + GOOD[2:] + "-extra"})
    assert ctx is not None
    assert ctx.traceparent() == GOOD


@pytest.mark.parametrize(
    "value",
    [
        "",
        "ff" + GOOD[2:],
        GOOD + "-extra",  # version 00 has exactly four fields
        GOOD.upper(),
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    ],
)
def test_invalid_traceparents_are_not_continued(value: str) -> None:
    """Malformed, version ff, upper case or all-zero ids: no context (a fresh one is made)."""
    assert trace_context.from_headers({"traceparent": value, "tracestate": "k=v"}) is None


def test_an_unprintable_or_long_tracestate_is_dropped() -> None:
    """tracestate over 512 characters or with control characters is not passed on."""
    for state in ("k=" + "v" * 600, "k=\x01"):
        ctx = trace_context.from_headers({"traceparent": GOOD, "tracestate": state})
        assert ctx is not None
        assert ctx.state is None


def test_fresh_traces_are_sampled_and_distinct() -> None:
    """A trace the gateway starts is sampled and never reuses an id."""
    a, b = trace_context.fresh(), trace_context.fresh()
    assert a.sampled
    assert a.trace_id != b.trace_id
    assert not a.from_client
    assert trace_context.from_headers({"traceparent": a.traceparent()}) is not None


@pytest.mark.parametrize(
    ("head", "ends"),
    [
        (b'event: response.completed\ndata: {"response"', True),
        (b"event: response.incomplete\r\ndata: {}", True),
        (b"event: response.failed\ndata: {}", True),
        (b"event: error\ndata: {}", True),
        (b"event: response.output_text.delta\ndata: {}", False),
        (b"event: response.completed_extra\ndata: {}", False),
        (b'data: {"type": "response.completed"}', False),
    ],
)
def test_a_responses_stream_ends_on_its_terminal_events(head: bytes, ends: bool) -> None:
    """The Responses API's completed, incomplete, failed and error events end its stream."""
    assert finished(head, RESPONSES.end_events) is ends
