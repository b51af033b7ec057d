"""What a client is told of its key's limits: OpenAI's reset durations and header names,
Anthropic's on the Messages routes, and the wording of a refusal."""

from __future__ import annotations

import datetime

import pytest

from gateway import errors
from gateway.dispatch.key_limits import OverLimit, Standing, Standings
from gateway.proxy.limiter import duration, refusal, standing_headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0004, "0s"), (0.012, "12ms"), (1, "1s"), (1.5, "1.5s"), (59.9951, "59.995s"),
     (360, "6m0s"), (61.25, "1m1.25s"), (3725.25, "1h2m5.25s")],
)  # fmt: skip
def test_durations_are_written_as_openai_writes_its_resets(seconds: float, text: str) -> None:
    """Go's duration style, to the millisecond, as in OpenAI's `x-ratelimit-reset-*`."""
    assert duration(seconds) == text


def test_openai_routes_get_x_ratelimit_headers_for_each_limit_the_key_has() -> None:
    """Requests and tokens each give limit, remaining and reset; concurrency gives none."""
    standings = Standings(requests=Standing(600, 599, 0.1), concurrent=Standing(4, 3, 0.0))
    assert standing_headers(standings, "openai") == {
        "x-ratelimit-limit-requests": "600",
        "x-ratelimit-remaining-requests": "599",
        "x-ratelimit-reset-requests": "100ms",
    }


def test_the_messages_routes_get_anthropics_headers_with_an_rfc_3339_reset() -> None:
    """anthropic-ratelimit-tokens-* with the reset as a UTC time a minute away."""
    headers = standing_headers(Standings(tokens=Standing(1000, 0, 60.0)), "anthropic")
    assert headers["anthropic-ratelimit-tokens-limit"] == "1000"
    assert headers["anthropic-ratelimit-tokens-remaining"] == "0"
    reset = datetime.datetime.fromisoformat(headers["anthropic-ratelimit-tokens-reset"])
    ahead = reset - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(seconds=58) < ahead <= datetime.timedelta(seconds=61)


def test_a_refusal_says_what_was_used_and_requested_and_when_to_come_back() -> None:
    """Worded as OpenAI words its own: limit, used, requested, and the wait."""
    refused = OverLimit("tokens", 1.2345, 300, Standings(tokens=Standing(1000, 100, 59.0)))
    error = refusal("team-a", refused)
    assert isinstance(error, errors.TokensRateLimited)
    assert error.message == (
        "Rate limit reached for key 'team-a' on tokens per min (TPM): Limit 1000, Used 900, "
        "Requested 300. Please try again in 1.234s."
    )
    response = error.response()
    assert (response.headers["retry-after-ms"], response.headers["Retry-After"]) == ("1234", "2")
