"""The gateway's own error answers: OpenAI's and Anthropic's error shapes and when to come back."""

from __future__ import annotations

import json

import pytest

from gateway import errors


@pytest.mark.parametrize(
    ("retry_after", "seconds", "millis"),
    [(0.25, "1", "250"), (1.0, "1", "1000"), (2.4, "3", "2400"), (0.0001, "1", "1")],
)
def test_retry_after_in_whole_seconds_and_exactly_in_milliseconds(
    retry_after: float, seconds: str, millis: str
) -> None:
    """`Retry-After` is whole seconds, at least 1 (RFC 9110); `retry-after-ms`, which the
    OpenAI SDK reads first, is the delay itself."""
    response = errors.Overloaded("busy", retry_after=retry_after).response()
    assert response.status == 429
    assert (response.headers["Retry-After"], response.headers["retry-after-ms"]) == (
        seconds,
        millis,
    )
    assert response.body is not None
    assert json.loads(bytes(response.body))["error"]["code"] == "overloaded"


def test_no_retry_headers_without_a_delay() -> None:
    response = errors.BadRequest("bad").response()
    assert "Retry-After" not in response.headers
    assert "retry-after-ms" not in response.headers


@pytest.mark.parametrize(
    ("error", "final"),
    [
        (errors.InvalidJSON("bad"), True),
        (errors.Unauthorized("who"), True),
        (errors.ModelNotFound("which"), True),
        (errors.MethodNotAllowed("how"), True),
        (errors.PayloadTooLarge("big"), True),
        (errors.RequestTimeout("slow"), False),
        (errors.Overloaded("busy", retry_after=1.5), False),
        (errors.UpstreamError("broke"), False),
        (errors.NoInstanceAvailable("none", retry_after=2), False),
        (errors.UpstreamTimeout("late"), False),
    ],
)
def test_an_answer_no_retry_can_change_tells_the_sdks_not_to_retry(
    error: errors.GatewayError, final: bool
) -> None:
    """A bad body, a wrong key, an unknown model or route, a body too large: the same
    request would get the same answer, so `x-should-retry: false` (both SDKs obey it);
    a timeout, an overload or an instance's failure may pass later, and says nothing."""
    for api in ("openai", "anthropic"):
        response = error.response(api=api)  # type: ignore[arg-type]
        assert (response.headers.get("x-should-retry") == "false") is final


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (errors.InvalidJSON("bad"), "invalid_request_error"),
        (errors.Unauthorized("who"), "authentication_error"),
        (errors.ModelNotFound("which"), "not_found_error"),
        (errors.MethodNotAllowed("how"), "invalid_request_error"),  # any other 4xx
        (errors.RequestTimeout("slow"), "invalid_request_error"),
        (errors.PayloadTooLarge("big"), "request_too_large"),
        (errors.Overloaded("busy", retry_after=1.5), "rate_limit_error"),
        (errors.UpstreamError("broke"), "api_error"),
        (errors.NoInstanceAvailable("none", retry_after=2), "overloaded_error"),
        (errors.QueueTimeout("waited", retry_after=2), "overloaded_error"),
        (errors.UpstreamTimeout("late"), "timeout_error"),
        (errors.GatewayError("oops"), "api_error"),
    ],
)
def test_on_an_anthropic_route_an_error_has_anthropics_shape_and_the_same_status(
    error: errors.GatewayError, kind: str
) -> None:
    """The same error on a Messages route: Anthropic's body, its type named by the status,
    and the status and Retry-After headers it has on every route."""
    openai, anthropic = error.response(), error.response(api="anthropic")
    assert anthropic.status == openai.status == error.status
    assert anthropic.body is not None
    body = json.loads(bytes(anthropic.body))
    assert body == {"type": "error", "error": {"type": kind, "message": error.message}}
    for header in ("Retry-After", "retry-after-ms"):
        assert anthropic.headers.get(header) == openai.headers.get(header)


def test_an_in_band_error_takes_the_shape_of_the_routes_api() -> None:
    """Mid-stream, OpenAI's routes get an error data event and [DONE]; Anthropic's an
    `error` event and nothing after it."""
    openai = errors.stream_error("cut", 502)
    assert openai.endswith(b"\n\ndata: [DONE]\n\n")
    assert json.loads(openai.split(b"\n\n")[0].removeprefix(b"data: "))["error"]["code"] == 502
    anthropic = errors.stream_error("cut", 503, api="anthropic")
    name, data = anthropic.removesuffix(b"\n\n").split(b"\n")
    assert name == b"event: error"
    assert json.loads(data.removeprefix(b"data: ")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "cut"},
    }
