"""Whether and when to try a request again, and the budget that stops retry storms.

Retries happen only before anything reached the client, to another instance where one
exists, within the request deadline and under a fleet-wide budget.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .model import Outcome

RetryReason = Literal["connect", "timeout", "status_429", "status_502", "status_503", "status_504"]


@dataclass(frozen=True)
class Verdict:
    """What an instance's HTTP status means: retry elsewhere (and why), and for its health."""

    retry: RetryReason | None  # None: the answer goes to the client as it is
    outcome: Outcome


# The one table of statuses the gateway treats specially. 429 and vLLM's 503 "engine
# busy" mean the request never reached the GPU: the instance is alive but full. 502 and
# 504 mean the instance (or something before it) is failing. Both kinds go elsewhere.
STATUS_VERDICTS: Mapping[int, Verdict] = {
    429: Verdict("status_429", Outcome.BUSY),
    502: Verdict("status_502", Outcome.FAILURE),
    503: Verdict("status_503", Outcome.BUSY),
    504: Verdict("status_504", Outcome.FAILURE),
}
_ANSWERED = Verdict(None, Outcome.SUCCESS)  # the instance worked, whatever it answered
_FAULT = Verdict(None, Outcome.FAILURE)  # another 5xx: passed on, but counts against it


def judge_status(status: int) -> Verdict:
    """The verdict on a status: the table's entry, else a fault from 500 up, else answered."""
    verdict = STATUS_VERDICTS.get(status)
    if verdict is not None:
        return verdict
    return _FAULT if status >= 500 else _ANSWERED


def reason_for_status(status: int) -> RetryReason | None:
    """The retry reason of a status, if it is retried (see `STATUS_VERDICTS`)."""
    return judge_status(status).retry


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Delay before retry number `attempt` (1-based): exponential with equal jitter.

    With base 0.5 and cap 8 the ranges are [0.25, 0.5], [0.5, 1], [1, 2], [2, 4], [4, 8],
    [4, 8], ...: never zero (so a burst of retries spreads) and never above the cap.
    """
    ceiling = min(cap, base * 2 ** max(0, attempt - 1))
    return float(ceiling / 2 + rng.uniform(0, ceiling / 2))


class RetryBudget:
    """Retries may add at most `ratio` of the requests seen in the last `window` seconds.

    A floor of `min_retries` per window (one a second by default, as Linkerd allows ten)
    keeps a quiet gateway able to retry at all; a storm needs volume, and then the ratio
    rules.
    Counts live in one bucket per second, so memory is fixed whatever the traffic.
    """

    def __init__(self, ratio: float = 0.2, min_retries: int = 10, window: int = 10) -> None:
        self.ratio = ratio
        self.min_retries = min_retries
        self.window = window
        self._requests = [0] * window
        self._retries = [0] * window
        self._stamp = [-1] * window
        # The other gateway processes' requests and retries in their last window, as
        # shared: with them the budget holds fleet-wide.
        self.peer_requests = 0
        self.peer_retries = 0

    def _bucket(self, now: float) -> int:
        second = int(now)
        index = second % self.window
        if self._stamp[index] != second:
            self._stamp[index] = second
            self._requests[index] = 0
            self._retries[index] = 0
        return index

    def own_totals(self, now: float) -> tuple[int, int]:
        """This process's requests and retries in the window (what it shares)."""
        return self._own_totals(now)

    def _totals(self, now: float) -> tuple[int, int]:
        requests, retries = self._own_totals(now)
        return requests + self.peer_requests, retries + self.peer_retries

    def _own_totals(self, now: float) -> tuple[int, int]:
        oldest = int(now) - self.window
        requests = retries = 0
        for i in range(self.window):
            if self._stamp[i] > oldest:
                requests += self._requests[i]
                retries += self._retries[i]
        return requests, retries

    def record_request(self, now: float) -> None:
        self._requests[self._bucket(now)] += 1

    def try_spend(self, now: float) -> bool:
        """Take one retry from the budget if there is one left."""
        requests, retries = self._totals(now)
        if retries >= max(self.min_retries, self.ratio * requests):
            return False
        self._retries[self._bucket(now)] += 1
        return True

    def __repr__(self) -> str:
        requests, retries = self._totals(max(self._stamp) if max(self._stamp) >= 0 else 0)
        return f"<RetryBudget ratio={self.ratio} requests={requests} retries={retries}>"


@dataclass(frozen=True)
class RetryAfter:
    delay: float


@dataclass(frozen=True)
class GiveUp:
    why: Literal["attempts", "deadline", "budget", "instances"]


def plan_retry(
    *,
    untried: bool,
    attempt: int,
    max_attempts: int,
    deadline: float,
    now: float,
    budget: RetryBudget,
    base: float,
    cap: float,
    rng: random.Random,
) -> RetryAfter | GiveUp:
    """After failed attempt number `attempt`, decide: retry after a delay, or give up.

    `untried`: whether an instance the request has not tried yet could take it now.
    Retries only go elsewhere, so without one there is nothing to plan (and no budget
    spent).
    """
    if not untried:
        return GiveUp("instances")
    if attempt >= max_attempts:
        return GiveUp("attempts")
    delay = backoff_delay(attempt, base, cap, rng)
    if now + delay >= deadline:
        return GiveUp("deadline")
    if not budget.try_spend(now):
        return GiveUp("budget")
    return RetryAfter(delay)
