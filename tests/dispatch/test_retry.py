"""Retry policy: jittered backoff, retryable statuses, the retry budget and plan_retry."""

from __future__ import annotations

import random

import pytest

from gateway.dispatch import (
    STATUS_VERDICTS,
    GiveUp,
    Outcome,
    RetryAfter,
    RetryBudget,
    Verdict,
    judge_status,
    plan_retry,
    reason_for_status,
)
from gateway.dispatch.retry import backoff_delay

# The docstring's ranges for base 0.5 and cap 8, attempts 1..7.
DOCSTRING_RANGES = [(0.25, 0.5), (0.5, 1), (1, 2), (2, 4), (4, 8), (4, 8), (4, 8)]


@pytest.mark.parametrize(("attempt", "bounds"), list(enumerate(DOCSTRING_RANGES, start=1)))
def test_backoff_stays_in_the_docstring_ranges(attempt: int, bounds: tuple[float, float]) -> None:
    """For base 0.5 and cap 8, each attempt's delay lies in the range the docstring shows."""
    low, high = bounds
    delays = [backoff_delay(attempt, 0.5, 8.0, random.Random(seed)) for seed in range(500)]
    assert all(low <= d <= high for d in delays)
    # Jitter really spreads: both halves of the range are used.
    middle = (low + high) / 2
    assert any(d < middle for d in delays)
    assert any(d > middle for d in delays)


@pytest.mark.parametrize("attempt", range(1, 30))
def test_backoff_is_never_zero_nor_above_cap(attempt: int) -> None:
    """Whatever the attempt, the delay is within [ceiling/2, ceiling] and at most the cap."""
    base, cap = 0.1, 3.0
    ceiling = min(cap, base * 2 ** (attempt - 1))
    for seed in range(50):
        delay = backoff_delay(attempt, base, cap, random.Random(seed))
        assert ceiling / 2 <= delay <= ceiling <= cap
        assert delay > 0


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_retryable_statuses_have_a_reason(status: int) -> None:
    """429, 502, 503 and 504 map to their `status_<code>` retry reason."""
    assert reason_for_status(status) == f"status_{status}"


@pytest.mark.parametrize("status", [200, 400, 401, 404, 408, 500, 501])
def test_other_statuses_are_not_retried(status: int) -> None:
    """Client errors, 500 and success are not retryable."""
    assert reason_for_status(status) is None


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, Verdict(None, Outcome.SUCCESS)),
        (400, Verdict(None, Outcome.SUCCESS)),  # the instance worked; the request was bad
        (404, Verdict(None, Outcome.SUCCESS)),
        (429, Verdict("status_429", Outcome.BUSY)),
        (500, Verdict(None, Outcome.FAILURE)),
        (501, Verdict(None, Outcome.FAILURE)),
        (502, Verdict("status_502", Outcome.FAILURE)),
        (503, Verdict("status_503", Outcome.BUSY)),
        (504, Verdict("status_504", Outcome.FAILURE)),
        (599, Verdict(None, Outcome.FAILURE)),
    ],
)
def test_each_status_has_one_verdict(status: int, verdict: Verdict) -> None:
    """Busy statuses retry as BUSY, failing gateways retry as FAILURE, other 5xx pass on as
    FAILURE and everything below 500 passes on as SUCCESS."""
    assert judge_status(status) == verdict


def test_the_table_holds_exactly_the_retried_statuses() -> None:
    """Every status in the table is retried, and every retried status is in the table."""
    assert all(v.retry == f"status_{s}" for s, v in STATUS_VERDICTS.items())
    retried = {s for s in range(100, 600) if judge_status(s).retry is not None}
    assert retried == set(STATUS_VERDICTS) == {429, 502, 503, 504}


# ------------------------------------------------------------------ budget


def spend_all(budget: RetryBudget, now: float, limit: int = 1000) -> int:
    """Spend retries at `now` until refused; return how many were granted."""
    granted = 0
    while budget.try_spend(now):
        granted += 1
        assert granted < limit, "the budget never refused"
    return granted


def test_budget_allows_ratio_of_requests() -> None:
    """With ratio 0.2 and 100 requests in the window, 20 retries pass and the 21st is refused."""
    budget = RetryBudget(ratio=0.2, min_retries=3, window=10)
    for i in range(100):
        budget.record_request(i * 0.09)  # spread over 9 seconds of the window
    assert spend_all(budget, 9.5) == 20
    assert budget.try_spend(9.5) is False


def test_budget_has_a_floor_when_quiet() -> None:
    """With no traffic, min_retries retries are still allowed per window."""
    budget = RetryBudget(ratio=0.2, min_retries=3, window=10)
    assert spend_all(budget, 0.0) == 3
    budget.record_request(0.5)  # 0.2 x 1 is still below the floor
    assert budget.try_spend(0.5) is False


def test_budget_forgets_after_the_window() -> None:
    """Requests and retries older than the window no longer count."""
    budget = RetryBudget(ratio=0.2, min_retries=3, window=10)
    for _ in range(100):
        budget.record_request(0.0)
    assert spend_all(budget, 0.0) == 20
    assert budget.try_spend(9.99) is False  # second 0 is still inside the window
    # At t=10 second 0 has left: back to the floor of 3, with no old retries held against it.
    assert spend_all(budget, 10.0) == 3


def test_budget_memory_is_fixed() -> None:
    """However long it runs, the budget keeps exactly one bucket per second of the window."""
    budget = RetryBudget(ratio=0.5, min_retries=1, window=7)
    for second in range(2000):
        for _ in range(3):
            budget.record_request(second + 0.25)
        budget.try_spend(second + 0.5)
    assert len(budget._requests) == len(budget._retries) == len(budget._stamp) == 7
    assert "requests=21" in repr(budget)
    assert "retries=7" in repr(budget)


# ------------------------------------------------------------------ plan_retry


def plan(
    *,
    untried: bool = True,
    attempt: int = 1,
    max_attempts: int = 3,
    deadline: float = 100.0,
    now: float = 0.0,
    budget: RetryBudget | None = None,
    seed: int = 0,
) -> RetryAfter | GiveUp:
    return plan_retry(
        untried=untried,
        attempt=attempt,
        max_attempts=max_attempts,
        deadline=deadline,
        now=now,
        budget=budget or RetryBudget(),
        base=0.5,
        cap=8.0,
        rng=random.Random(seed),
    )


def test_plan_gives_up_without_an_untried_instance_before_anything_else() -> None:
    """No untried instance: give up for instances, even past max attempts, budget untouched."""
    budget = RetryBudget(ratio=0.0, min_retries=1)
    assert plan(untried=False, budget=budget) == GiveUp("instances")
    assert plan(untried=False, attempt=5, max_attempts=3) == GiveUp("instances")
    assert plan(untried=False, deadline=0.0) == GiveUp("instances")
    assert budget.try_spend(0.0) is True  # the refusal spent nothing


def test_plan_gives_up_at_max_attempts() -> None:
    """After attempt number max_attempts there is no further retry."""
    assert plan(attempt=3, max_attempts=3) == GiveUp("attempts")
    assert plan(attempt=4, max_attempts=3) == GiveUp("attempts")


def test_plan_gives_up_when_the_delay_reaches_the_deadline() -> None:
    """A retry that could only start at or after the deadline is not planned."""
    delay = backoff_delay(1, 0.5, 8.0, random.Random(7))
    assert plan(now=10.0, deadline=10.0 + delay, seed=7) == GiveUp("deadline")
    assert plan(now=10.0, deadline=10.0 + delay + 1e-6, seed=7) == RetryAfter(delay)


def test_plan_deadline_give_up_does_not_spend_budget() -> None:
    """Giving up for the deadline leaves the retry budget untouched."""
    budget = RetryBudget(ratio=0.0, min_retries=1)
    assert plan(deadline=0.1, budget=budget) == GiveUp("deadline")
    assert budget.try_spend(0.0) is True


def test_plan_gives_up_when_the_budget_is_spent() -> None:
    """With the budget exhausted, a retry is refused for budget."""
    budget = RetryBudget(ratio=0.0, min_retries=2)
    assert isinstance(plan(budget=budget), RetryAfter)
    assert isinstance(plan(budget=budget), RetryAfter)
    assert plan(budget=budget) == GiveUp("budget")


@pytest.mark.parametrize(("attempt", "bounds"), list(enumerate(DOCSTRING_RANGES[:4], start=1)))
def test_plan_retries_after_the_backoff_delay(attempt: int, bounds: tuple[float, float]) -> None:
    """Within attempts, deadline and budget, the plan is a retry after the backoff delay."""
    for seed in range(20):
        decision = plan(attempt=attempt, max_attempts=10, seed=seed)
        assert decision == RetryAfter(backoff_delay(attempt, 0.5, 8.0, random.Random(seed)))
        assert bounds[0] <= decision.delay <= bounds[1]
