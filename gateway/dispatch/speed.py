"""Per-instance speed learned from live traffic, and the slow-card flag.

Two estimates per instance, both moving averages that fall fast and recover slowly
(PeakEWMA's idea): a slowdown shows within a few requests, while one lucky fast sample
does not undo it.

- prefill rate, tokens/s: (prompt tokens queued ahead at the instance when the request
  was sent + its own prompt tokens) / time from send to first token. Counting the work
  ahead nets out queueing at the instance: a busy fast card is not mistaken for a slow one.
- decode time per output token, seconds (TPOT), from streamed answers.

Memory is constant: two floats and two counters per instance.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

# Weight of a new sample that shows the instance slower than its estimate, and faster.
REACT = 0.5
RECOVER = 0.1


@dataclass
class Ewma:
    """An asymmetric moving average; `higher_is_better` says which way is "slower"."""

    higher_is_better: bool
    value: float | None = None
    samples: int = 0

    def update(self, sample: float) -> None:
        if sample <= 0 or sample != sample:  # no zero, negative or NaN samples
            return
        self.samples += 1
        if self.value is None:
            self.value = sample
            return
        worse = sample < self.value if self.higher_is_better else sample > self.value
        weight = REACT if worse else RECOVER
        self.value += weight * (sample - self.value)


@dataclass
class Speed:
    """What the gateway has learned about one instance's speed."""

    prefill: Ewma
    tpot: Ewma
    slow: bool = False
    verdicts: int = 0  # consecutive evaluations that disagreed with `slow`

    @classmethod
    def new(cls) -> Speed:
        return cls(prefill=Ewma(higher_is_better=True), tpot=Ewma(higher_is_better=False))

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self.prefill.update(tokens / seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.update(seconds)


def median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def relative_speed(speed: Speed, prefill_median: float | None, tpot_median: float | None) -> float:
    """This instance's speed as a fraction of the fleet median (1.0 = typical, 0.4 = slow).

    The worse of prefill and decode decides; an unknown side counts as typical.
    """
    ratios = [1.0]
    if speed.prefill.value is not None and prefill_median:
        ratios.append(speed.prefill.value / prefill_median)
    if speed.tpot.value is not None and tpot_median:
        ratios.append(tpot_median / speed.tpot.value)
    return min(ratios)


SLOW_BELOW = 0.6  # flag an instance under 60% of the fleet median...
SLOW_CLEARS_ABOVE = 0.8  # ...and clear the flag only once it is back over 80%
CONFIRM = 2  # ...in this many evaluations (health rounds) in a row
MIN_SAMPLES = 5


def update_slow_flags(speeds: dict[str, Speed]) -> dict[str, bool]:
    """Re-evaluate every instance's slow flag; return the flags that changed.

    Needs at least two instances with history: "slow" is relative to the fleet.
    Hysteresis and `CONFIRM` rounds in a row keep a card near the line from flapping.
    """
    prefill_median = median(s.prefill.value for s in speeds.values())
    tpot_median = median(s.tpot.value for s in speeds.values())
    with_history = sum(
        1 for s in speeds.values() if max(s.prefill.samples, s.tpot.samples) >= MIN_SAMPLES
    )
    changed: dict[str, bool] = {}
    for name, speed in speeds.items():
        enough = max(speed.prefill.samples, speed.tpot.samples) >= MIN_SAMPLES
        ratio = relative_speed(speed, prefill_median, tpot_median)
        if with_history < 2 or not enough:
            flag = False
        elif speed.slow:
            flag = ratio < SLOW_CLEARS_ABOVE
        else:
            flag = ratio < SLOW_BELOW
        if flag == speed.slow:
            speed.verdicts = 0
            continue
        speed.verdicts += 1
        if speed.verdicts >= CONFIRM or not enough:
            speed.slow, speed.verdicts = flag, 0
            changed[name] = flag
    return changed
