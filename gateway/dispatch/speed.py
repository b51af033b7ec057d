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
from collections.abc import Iterable, Sequence
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


# Blending with other processes: each estimate weighs by its samples, up to this many,
# so a long history does not outvote a fresh one forever.
BLEND_CAP = 20


@dataclass(frozen=True)
class PeerSpeed:
    """Another gateway process's learned speed of one instance, with its sample counts."""

    prefill: float | None = None
    prefill_samples: int = 0
    tpot: float | None = None
    tpot_samples: int = 0


def _blend(own: Ewma, others: Iterable[tuple[float | None, int]]) -> tuple[float | None, int]:
    """The sample-weighted mean of `own` and `others`' values, and their samples in all."""
    weighted = total = 0.0
    samples = 0
    for value, n in [(own.value, own.samples), *others]:
        if value is None or n <= 0:
            continue
        weight = min(n, BLEND_CAP)
        weighted += value * weight
        total += weight
        samples += n
    return (weighted / total if total else None), samples


@dataclass
class Speed:
    """What the gateway has learned about one instance's speed (and its peers, if shared)."""

    prefill: Ewma
    tpot: Ewma
    slow: bool = False
    verdicts: int = 0  # consecutive evaluations that disagreed with `slow`
    # Blended with the other gateway processes' estimates; None without a shared view.
    shared_prefill: float | None = None
    shared_tpot: float | None = None
    shared_samples: int = 0

    @property
    def prefill_rate(self) -> float | None:
        """Prefill tokens/s to predict with: the fleet of gateways' blend, else our own."""
        return self.shared_prefill if self.shared_prefill is not None else self.prefill.value

    @property
    def tpot_value(self) -> float | None:
        return self.shared_tpot if self.shared_tpot is not None else self.tpot.value

    @property
    def samples(self) -> int:
        own = max(self.prefill.samples, self.tpot.samples)
        return max(own, self.shared_samples)

    def own(self) -> PeerSpeed:
        """Our own estimates, as we publish them for the other processes."""
        return PeerSpeed(
            self.prefill.value, self.prefill.samples, self.tpot.value, self.tpot.samples
        )

    def blend(self, peers: Sequence[PeerSpeed]) -> None:
        """Blend our estimates with the peers' (none: back to our own)."""
        if not peers:
            self.shared_prefill = self.shared_tpot = None
            self.shared_samples = 0
            return
        self.shared_prefill, prefill_n = _blend(
            self.prefill, ((p.prefill, p.prefill_samples) for p in peers)
        )
        self.shared_tpot, tpot_n = _blend(self.tpot, ((p.tpot, p.tpot_samples) for p in peers))
        self.shared_samples = max(prefill_n, tpot_n)

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
    prefill, tpot = speed.prefill_rate, speed.tpot_value
    if prefill is not None and prefill_median:
        ratios.append(prefill / prefill_median)
    if tpot and tpot_median:
        ratios.append(tpot_median / tpot)
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
    prefill_median = median(s.prefill_rate for s in speeds.values())
    tpot_median = median(s.tpot_value for s in speeds.values())
    with_history = sum(1 for s in speeds.values() if s.samples >= MIN_SAMPLES)
    changed: dict[str, bool] = {}
    for name, speed in speeds.items():
        enough = speed.samples >= MIN_SAMPLES
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
