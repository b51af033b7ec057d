"""The gateway's own error answers: OpenAI's error shape and when to come back."""

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
