"""The highest rate a setup serves within the SLO: a bisection over judged rates.

`Bisection` decides which rate to try next from the verdicts so far and does no I/O; a
driver judges each rate (a real run of seconds, or the model's in milliseconds) and records
the verdict. The search assumes that serving gets no easier as the rate grows, which the
common-random-number schedule (`schedule.py`) makes true of one seed in all but near-ties.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class Bisection:
    """Bisect [low, high] for the highest served rate, in `steps` halvings.

    The bracket is checked first: a `low` that fails is halved, a `high` that passes is
    doubled, at most `widen` times each, so a guess off by up to 2**widen still brackets.
    For low=4, high=8, steps=2, with 5.5 the true capacity, it tries 4 (served), 8, 6, 5
    and ends with capacity 5: resolution (high - low) / 2**steps.
    """

    low: float
    high: float
    steps: int
    widen: int = 3
    tried: list[tuple[float, bool]] = field(default_factory=list)
    _phase: str = "low"
    _widened: int = 0
    _high_fails: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high or self.steps < 0:
            raise ValueError(f"need 0 < low < high and steps >= 0: {self.low}, {self.high}")

    @property
    def capacity(self) -> float:
        """The highest rate served so far (0.0 when none was)."""
        return max((rate for rate, ok in self.tried if ok), default=0.0)

    def next(self) -> float | None:
        """The rate to judge next; None once the search is over."""
        if self._phase == "low":
            return self.low
        if self._phase == "high":
            return self.high
        if self._phase == "bisect" and self.steps > 0:
            return (self.low + self.high) / 2
        return None

    def record(self, rate: float, served: bool) -> None:
        """The verdict on the rate `next` gave."""
        self.tried.append((rate, served))
        if self._phase == "low":
            if served:
                self._phase, self._widened = ("bisect" if self._high_fails else "high"), 0
            elif self._widened < self.widen:
                self.low, self.high, self._high_fails = self.low / 2, self.low, True
                self._widened += 1
            else:
                self._phase = "done"
        elif self._phase == "high":
            if not served:
                self._phase = "bisect"
            elif self._widened < self.widen:
                self.low, self.high = self.high, self.high * 2
                self._widened += 1
            else:
                self._phase = "done"
        else:
            if served:
                self.low = rate
            else:
                self.high = rate
            self.steps -= 1


def search(served: Callable[[float], bool], bisection: Bisection) -> Bisection:
    """Run a bisection with a verdict that costs no waiting (the model's)."""
    while (rate := bisection.next()) is not None:
        bisection.record(rate, served(rate))
    return bisection


async def search_async(
    served: Callable[[float], Awaitable[bool]], bisection: Bisection
) -> Bisection:
    """Run a bisection whose verdicts are runs to await (the real simulator's)."""
    while (rate := bisection.next()) is not None:
        bisection.record(rate, await served(rate))
    return bisection
