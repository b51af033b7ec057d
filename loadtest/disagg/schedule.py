"""Poisson arrivals for the SLO-attainment runs, seeded, on common random numbers.

One seed draws one sequence of unit-rate exponential gaps; a rate scales it. So the runs
of a capacity search see the same arrival pattern, only compressed or stretched, and the
share of requests meeting the objectives falls with the rate instead of jumping with a new
draw at every rate tried.
"""

from __future__ import annotations

import random


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival offsets in seconds, in [0, duration), of a Poisson process of `rate` per second.

    The first request comes at 0. `arrivals(2 * r, d / 2, s)` is `arrivals(r, d, s)` halved.
    """
    if rate <= 0 or duration <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate} and {duration}")
    rng = random.Random(seed)
    times, unit = [], 0.0
    while unit / rate < duration:
        times.append(unit / rate)
        unit += rng.expovariate(1.0)
    return times
