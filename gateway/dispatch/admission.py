"""Admission: refuse at once a request that could not start before its time runs out.

When every instance is at its limit, a request waits in its lane's queue. How long it
will wait follows from two numbers the gateway already has: how many requests must
start before it (the queue ahead of it, plus those waiting at the instances beyond
their running slots) and how fast the lane drains while it is saturated (a request
departs when it frees the place that held the next one back: its slot, or on a shared
instance a long request's prefill place). By Little's law the wait is about

    wait = (ahead + 1) / departure rate

Its budget is what is left of its deadline, capped by the lane's `max_queue_wait`, less
the time the lane's requests take from being sent to their first token (learned): a
request that starts at the end of its budget should still see its first token within
the objective. Beyond the budget, it is refused now with 429 and a `Retry-After` of the
excess, instead of holding its client until the budget runs out. The excess is also sent
exactly, in milliseconds: a client that retries (the OpenAI SDK does, twice by default,
and reads `retry-after-ms` first) comes back when the queue should have room, soon enough
to meet an objective that a whole-second `Retry-After` would have made it miss.

The departure rate counts only departures that found requests waiting, and the gaps between
them: those gaps are the fleet's service time, not lulls in arrivals. So refusing does
not lower the measured rate (a lane with requests refused still has a queue), there is
no feedback loop that could shrink admissions toward nothing, and the admitted queue is
bounded by rate x budget and its wait by the budget. Envoy's gradient controller, by
contrast, can oscillate and lowers its limit on purpose to probe; CoDel needs a standing
queue to see a long sojourn before it sheds, so the first burst still waits. While the
rate is unknown (fewer than `MIN_DEPARTURES` saturated gaps in the window), nothing is
refused by prediction and the budget's timer still bounds every wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from .model import Lane, Priority, RateKey

MIN_DEPARTURES = 3
WINDOW = 30.0  # seconds of saturated departures the departure rate is measured over


class Throughput:
    """How fast one lane drains while saturated: departures per second, from the gaps
    between departures that found requests waiting, over the last `WINDOW` seconds."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._gaps: deque[tuple[float, float]] = deque()  # (when, seconds since the last)
        self._total = 0.0
        self._last: float | None = None  # the previous departure, if it found a queue

    def record(self, now: float, saturated: bool = True) -> None:
        """A departure; `saturated`: requests of the lane were waiting when it happened."""
        if saturated and self._last is not None:
            gap = max(0.0, now - self._last)
            self._gaps.append((now, gap))
            self._total += gap
        self._last = now if saturated else None
        self._trim(now)

    def rate(self, now: float) -> float | None:
        """Departures per second while saturated, or None while too few were seen."""
        self._trim(now)
        if len(self._gaps) < MIN_DEPARTURES or self._total <= 0:
            return None
        return len(self._gaps) / self._total

    def _trim(self, now: float) -> None:
        horizon = now - self.window
        gaps = self._gaps
        while gaps and gaps[0][0] <= horizon:
            self._total -= gaps.popleft()[1]

    def __repr__(self) -> str:
        return f"<Throughput {len(self._gaps)} saturated gaps in {self.window:g}s>"


def predicted_wait(ahead: float, rate: float | None) -> float | None:
    """Seconds until a request with `ahead` requests before it starts (None: unknown)."""
    if rate is None or rate <= 0:
        return None
    return (ahead + 1) / rate


def refusal(ahead: float, rate: float | None, budget: float) -> float | None:
    """None to admit; else how long until it could be admitted: the excess of its
    predicted wait over its budget, and never less than the usual gap between
    departures (1 / rate), before which the queue has most likely not moved. The shell
    sends it as `Retry-After` in whole seconds (at least 1) and exactly as
    `retry-after-ms`, which the OpenAI SDK reads first.

    >>> refusal(9, 2.0, 10.0) is None      # waits 5 s, has 10
    True
    >>> refusal(39, 2.0, 10.0)             # waits 20 s, has 10: try again in 10 s
    10.0
    >>> refusal(20, 10.0, 2.05)            # 2.1 s, has 2.05: not before the next departure
    0.1
    """
    wait = predicted_wait(ahead, rate)
    if wait is None or rate is None or wait <= budget:
        return None
    return max(1.0 / rate, wait - budget)


class DepartureRates:
    """The fleet's saturated departure rate per lane, model and class: our own departures,
    measured, plus the other gateway processes' rates as they last said (their queues
    count in the requests ahead, so their rates must count too).

    Per class, so that Little's law holds for each: a batch request waits for the batch
    requests ahead of it, at the rate batch requests leave while some wait (what the
    interactive ones, served first, leave to them). With one rate for both, batch would
    be admitted by the whole fleet's rate, wait behind every interactive request that
    came after it, and run out its wait in the queue instead of being refused at once.
    """

    def __init__(self) -> None:
        self._own: dict[RateKey, Throughput] = {}
        self.peers: Mapping[RateKey, float] = {}

    def record(
        self,
        lane: Lane,
        model: str | None,
        now: float,
        saturated: bool,
        priority: Priority = Priority.INTERACTIVE,
    ) -> None:
        key = (lane, model, priority)
        throughput = self._own.get(key)
        if throughput is None:
            throughput = self._own[key] = Throughput()
        throughput.record(now, saturated)

    def rate(
        self, lane: Lane, model: str | None, now: float, priority: Priority = Priority.INTERACTIVE
    ) -> float | None:
        """Requests of a class a second the fleet starts while saturated (None: not known
        yet)."""
        key = (lane, model, priority)
        throughput = self._own.get(key)
        own = throughput.rate(now) if throughput is not None else None
        peers = self.peers.get(key)
        return own if peers is None else (own or 0.0) + peers

    def own(self, now: float) -> dict[RateKey, float]:
        """Our own known rates, to tell the other processes."""
        return {
            key: rate
            for key, throughput in self._own.items()
            if (rate := throughput.rate(now)) is not None
        }
