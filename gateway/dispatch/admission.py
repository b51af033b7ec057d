"""Admission: refuse at once a request that could not start before its time runs out.

When every instance is at its limit, a request waits in its lane's queue. How long it
will wait follows from two numbers the gateway already has: how many requests must
start before it (the queue ahead of it, plus those waiting at the instances beyond
their running slots) and how fast the lane lets requests go (its departures per
second over the last few seconds: a request departs when it frees the place that
held the next one back — its slot, or on a shared instance a long request's prefill
place). By Little's law the wait is about

    wait = (ahead + 1) / departure rate

If that is beyond the request's budget (what is left of its deadline, capped by the
lane's `max_queue_wait`), it is refused now with 429 and a `Retry-After` of the excess,
instead of holding its client until the budget runs out.

Why this and not CoDel or an adaptive concurrency limit: the departure rate is measured
on the instances, downstream of the queue, so refusing requests does not change it;
the admitted queue is then bounded by rate x budget and its wait by the budget, with no
feedback loop that could oscillate (Envoy's gradient controller can, and needs a
probing phase that lowers the limit on purpose). CoDel needs a standing queue to see a
long sojourn before it sheds, so the first burst still waits; this predicts from the
first request. While the rate is unknown (fewer than `MIN_DEPARTURES` in the window),
nothing is refused by prediction and the budget's timer still bounds every wait.
"""

from __future__ import annotations

import math
from collections import deque

MIN_DEPARTURES = 3
WINDOW = 5.0  # seconds of departures the rate is measured over


class Throughput:
    """Departures per second of one lane over a sliding window of `WINDOW` seconds."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._times: deque[float] = deque()
        self._first: float | None = None

    def record(self, now: float) -> None:
        if self._first is None:
            self._first = now
        self._times.append(now)
        self._trim(now)

    def rate(self, now: float) -> float | None:
        """Departures per second, or None while too few were seen to tell."""
        self._trim(now)
        if len(self._times) < MIN_DEPARTURES or self._first is None:
            return None
        # Early on the window is not full yet: divide by the time actually observed.
        span = min(self.window, max(now - self._first, 0.5))
        return len(self._times) / span

    def _trim(self, now: float) -> None:
        horizon = now - self.window
        times = self._times
        while times and times[0] <= horizon:
            times.popleft()

    def __repr__(self) -> str:
        return f"<Throughput {len(self._times)} in {self.window:g}s>"


def predicted_wait(ahead: int, rate: float | None) -> float | None:
    """Seconds until a request with `ahead` requests before it starts (None: unknown)."""
    if rate is None or rate <= 0:
        return None
    return (ahead + 1) / rate


def refusal(ahead: int, rate: float | None, budget: float) -> float | None:
    """None to admit; else how long until it could be admitted (its Retry-After, >= 1 s).

    >>> refusal(9, 2.0, 10.0) is None      # waits 5 s, has 10
    True
    >>> refusal(39, 2.0, 10.0)             # waits 20 s, has 10: try again in 10 s
    10.0
    """
    wait = predicted_wait(ahead, rate)
    if wait is None or wait <= budget:
        return None
    return max(1.0, float(math.ceil(wait - budget)))
