"""A key's limits as the core decides them: GCRA windows, token reservation and settlement,
requests at once; plain function calls on a clock the test moves."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch.key_limits import (
    CONCURRENT_RETRY_S,
    Admitted,
    KeyLimits,
    KeyQuota,
    OverLimit,
    Standing,
    admit_gcra,
    decide,
    standing_gcra,
    wait_gcra,
)

T0 = 1000.0  # any clock origin: the state starts full whatever it is


def admitted_at_once(quota: KeyQuota, limits: KeyLimits, count: int, tokens: int = 0) -> int:
    return sum(isinstance(quota.admit(limits, tokens, T0), Admitted) for _ in range(count))


@pytest.mark.parametrize("per_minute", [1, 7, 10, 600, 1000])
def test_an_idle_key_may_spend_its_whole_minute_at_once_and_no_more(per_minute: int) -> None:
    """From a full bucket exactly `requests_per_minute` requests pass at one instant."""
    limits = KeyLimits(requests_per_minute=per_minute)
    assert admitted_at_once(KeyQuota(), limits, per_minute + 5) == per_minute


def test_a_refused_request_waits_one_interval_and_then_passes() -> None:
    """After the burst, the next request is told to wait 60 / limit seconds, and passes then."""
    limits = KeyLimits(requests_per_minute=10)
    quota = KeyQuota()
    admitted_at_once(quota, limits, 10)
    refused = quota.admit(limits, 0, T0 + 1.0)
    assert isinstance(refused, OverLimit)
    assert refused.limit == "requests"
    assert refused.retry_after == pytest.approx(5.0)  # 6 s an interval, 1 s gone
    assert isinstance(quota.admit(limits, 0, T0 + 6.0), Admitted)
    assert isinstance(quota.admit(limits, 0, T0 + 6.0), OverLimit)


@pytest.mark.parametrize(("per_minute", "window"), [(600, 60.0), (10, 120.0), (200, 30.0)])
def test_a_key_sending_three_times_its_limit_gets_its_limit_plus_the_window(
    per_minute: int, window: float
) -> None:
    """Driven at 3x, a key gets its burst plus the limit x window / 60, whatever the pace."""
    limits = KeyLimits(requests_per_minute=per_minute)
    quota = KeyQuota()
    gap = 60.0 / per_minute / 3
    sent = int(window / gap)
    admitted = sum(
        isinstance(quota.admit(limits, 0, T0 + i * gap), Admitted) for i in range(sent + 1)
    )
    assert admitted == per_minute + int(window * per_minute / 60 + 1e-9)


def test_tokens_are_reserved_at_admission_and_refunded_at_settlement() -> None:
    """A reservation of 1500 of 2000 leaves room for 500; settling at 100 used gives back 1400."""
    limits = KeyLimits(tokens_per_minute=2000)
    quota = KeyQuota()
    assert isinstance(quota.admit(limits, 1500, T0), Admitted)
    assert isinstance(quota.admit(limits, 600, T0), OverLimit)
    quota.settle(limits, 100 - 1500, T0)
    standing = quota.standings(limits, T0).tokens
    assert standing == Standing(2000, 1900, pytest.approx(3.0))
    assert isinstance(quota.admit(limits, 1900, T0), Admitted)


def test_a_refund_never_fills_the_bucket_past_full() -> None:
    """A refund settled once the bucket is full again banks nothing: another request's
    debt settled after it still counts. Two requests reserve 1500 and 500 of 2000 a
    minute; a minute later (full again) the first uses none, the second 1000 more than
    it reserved: 1000 of debt, so 1000 tokens are left, not 2000."""
    limits = KeyLimits(tokens_per_minute=2000)
    quota = KeyQuota()
    assert isinstance(quota.admit(limits, 1500, T0), Admitted)
    assert isinstance(quota.admit(limits, 500, T0), Admitted)
    quota.settle(limits, -1500, T0 + 60.0)
    quota.settle(limits, 1000, T0 + 60.0)
    assert quota.standings(limits, T0 + 60.0).tokens == Standing(2000, 1000, pytest.approx(30.0))
    assert isinstance(quota.admit(limits, 1001, T0 + 60.0), OverLimit)
    assert isinstance(quota.admit(limits, 1000, T0 + 60.0), Admitted)


def test_answers_longer_than_reserved_put_the_key_in_debt() -> None:
    """Settling 3000 more than reserved leaves nothing, and the wait covers the debt."""
    limits = KeyLimits(tokens_per_minute=6000)  # 100 tokens a second
    quota = KeyQuota()
    assert isinstance(quota.admit(limits, 1000, T0), Admitted)
    quota.settle(limits, 8000, T0)  # used 9000 in all: 3000 past a full minute
    refused = quota.admit(limits, 100, T0)
    assert isinstance(refused, OverLimit)
    assert refused.retry_after == pytest.approx(31.0)  # 3000 tokens of debt plus 100 more
    assert refused.standings.tokens == Standing(6000, 0, pytest.approx(90.0))


def test_a_request_larger_than_the_limit_is_never_admitted() -> None:
    """Tokens over a minute's worth are refused with no retry time, even from a full bucket."""
    limits = KeyLimits(tokens_per_minute=1000)
    refused = KeyQuota().admit(limits, 1001, T0)
    assert isinstance(refused, OverLimit)
    assert (refused.limit, refused.retry_after, refused.requested) == ("tokens", None, 1001)
    assert wait_gcra(-math.inf, T0, 1000, 1000) == 0.0


def test_requests_at_once_are_counted_and_given_back() -> None:
    """A third request of a key allowed two at once waits until one of the two ends."""
    limits = KeyLimits(max_concurrent=2)
    quota = KeyQuota()
    assert admitted_at_once(quota, limits, 3) == 2
    refused = quota.admit(limits, 0, T0)
    assert isinstance(refused, OverLimit)
    assert (refused.limit, refused.retry_after) == ("concurrent", CONCURRENT_RETRY_S)
    quota.settle(limits, 0, T0)
    verdict = quota.admit(limits, 0, T0)
    assert isinstance(verdict, Admitted)
    assert verdict.standings.concurrent == Standing(2, 0, 0.0)


def test_a_refusal_charges_no_limit() -> None:
    """A request refused by its tokens takes neither a request nor a place."""
    limits = KeyLimits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=1)
    quota = KeyQuota()
    before = repr(quota)
    assert isinstance(quota.admit(limits, 500, T0), OverLimit)
    assert repr(quota) == before
    assert isinstance(quota.admit(limits, 50, T0), Admitted)


def test_the_refusal_named_is_the_longest_wait() -> None:
    """OverLimit by requests (6 s) and tokens (30 s) at once, the client hears of the tokens."""
    limits = KeyLimits(requests_per_minute=10, tokens_per_minute=120)
    verdict, _, _ = decide(limits, T0 + 60.0, T0 + 60.0, 0, 60, T0)
    assert isinstance(verdict, OverLimit)
    assert (verdict.limit, verdict.retry_after) == ("tokens", pytest.approx(30.0))


def test_standings_after_an_admission_count_the_request() -> None:
    """After 3 of 10 requests and 250 of 1000 tokens, 7 and 750 remain, with the resets."""
    limits = KeyLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=4)
    quota = KeyQuota()
    for _ in range(2):
        quota.admit(limits, 0, T0)
    verdict = quota.admit(limits, 250, T0)
    assert isinstance(verdict, Admitted)
    assert verdict.standings.requests == Standing(10, 7, pytest.approx(18.0))
    assert verdict.standings.tokens == Standing(1000, 750, pytest.approx(15.0))
    assert verdict.standings.concurrent == Standing(4, 1, 0.0)


def test_a_key_without_limits_is_always_admitted_with_no_standing() -> None:
    """No limit configured: every request passes and nothing is reported."""
    limits = KeyLimits()
    assert not limits.any
    verdict = KeyQuota().admit(limits, 10**9, T0)
    assert isinstance(verdict, Admitted)
    assert verdict.standings.requests is verdict.standings.tokens is None


def test_the_bucket_refills_continuously() -> None:
    """Half a minute after spending it all, half the limit is back."""
    assert standing_gcra(T0 + 60.0, T0 + 30.0, 600) == Standing(600, 300, 30.0)
    assert admit_gcra(T0 + 60.0, T0 + 30.0, 300, 600) == pytest.approx(T0 + 90.0)
    assert admit_gcra(T0 + 60.0, T0 + 30.0, 301, 600) is None


@settings(max_examples=300, deadline=None)
@given(
    per_minute=st.integers(1, 500),
    gaps=st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=120),
    costs=st.lists(st.integers(1, 40), min_size=1, max_size=120),
)
def test_no_window_ever_admits_more_than_the_bucket_and_its_refill(
    per_minute: int, gaps: list[float], costs: list[int]
) -> None:
    """Whatever the arrivals, in any span of d seconds the admitted cost is at most the
    limit plus limit x d / 60 (the GCRA bound: a full bucket and its refill)."""
    limits = KeyLimits(tokens_per_minute=per_minute)
    quota = KeyQuota()
    now, admitted = T0, []
    for gap, cost in zip(gaps, costs * (len(gaps) // len(costs) + 1), strict=False):
        now += gap
        if isinstance(quota.admit(limits, cost, now), Admitted):
            admitted.append((now, cost))
    for i, (start, _) in enumerate(admitted):
        spent = 0
        for at, cost in admitted[i:]:
            spent += cost
            assert spent <= per_minute + per_minute * (at - start) / 60 + 1e-6
