"""DistServe's objectives and attainment: the share of requests that meet TTFT and TPOT.

As in DistServe's evaluation code (`evaluation/2-benchmark-serving/structs.py`): TTFT is the
time to the first token; TPOT is (time of the last token - time of the first) / (output
tokens - 1), and 0 for a one-token answer; a request attains the SLO when it meets both,
and a rate is served when at least 90% of its requests do. Figure 1's objectives (OPT-13B,
input 512, output 64) are a P90 TTFT of 0.4 s and a P90 TPOT of 0.04 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds (None: not judged), and the share that must meet them."""

    ttft: float | None = 0.4
    tpot: float | None = 0.04
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be within (0, 1], got {self.attainment}")


FIGURE_1 = Slo()


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it; times in seconds, None when it never got there."""

    ttft: float | None
    tpot: float | None
    tokens: int
    error: str | None = None

    @classmethod
    def from_times(cls, sent: float, token_times: Sequence[float]) -> Outcome:
        """From the send time and the arrival time of each output token."""
        if not token_times:
            return cls(None, None, 0, "no tokens")
        n = len(token_times)
        tpot = 0.0 if n == 1 else (token_times[-1] - token_times[0]) / (n - 1)
        return cls(token_times[0] - sent, tpot, n)


def meets(outcome: Outcome, slo: Slo) -> bool:
    """Whether a request met every objective the SLO judges (a failed one meets none)."""
    if outcome.error is not None or outcome.ttft is None or outcome.tpot is None:
        return False
    if slo.ttft is not None and outcome.ttft > slo.ttft:
        return False
    return slo.tpot is None or outcome.tpot <= slo.tpot


def attainment(outcomes: Sequence[Outcome], slo: Slo) -> float:
    """The share of requests that met the SLO; 0 for no requests."""
    if not outcomes:
        return 0.0
    return sum(meets(o, slo) for o in outcomes) / len(outcomes)


def served(outcomes: Sequence[Outcome], slo: Slo) -> bool:
    """Whether the rate that produced `outcomes` is served within the SLO."""
    return bool(outcomes) and attainment(outcomes, slo) >= slo.attainment
