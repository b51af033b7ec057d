"""A long place that opens just before its prefill ends (`[prefill] long_prefetch`).

Why: with `max_long_per_instance` places and a queue of long prompts, a place frees at
the first token of the prefill that holds it. The next long prompt then crosses the
gateway and the network while the card runs a decode step or two without it, and
only the step after that prefills it. In a burst that gap is the card's long-prompt
throughput: a 6,000-token prefill is one 0.3 s step on a speed-1 card, and about
25 ms of gap between two of them is 8% of the card's prefill time, at the moment the
long queue is growing.

So a place opens `long_prefetch` of its holder's predicted prefill time before the
predicted end: the next long prompt reaches the card while the holder's prefill step
runs, waits there (vLLM schedules between steps), and its prefill is the next step.
At most one prompt waits per place: the one sent early holds a place of its own from
then on, due when the holder's is plus its own prefill time. A holder whose first
token is late keeps its place open only once; nothing else changes for it.

Each place's time comes from the card's learned prefill rate (the time from sending to
the first token, per uncached token, so the card's step and network times are in it),
which makes the prediction one of the quantities least_time already trusts. Without a
rate yet a place opens only at the first token, as without the setting. The other
gateway processes' long prompts there count as held to their first token: their times
are not shared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .model import InstanceState, LongPlace


def place(
    now: float, uncached: int, rate: float | None, share: float, held: Iterable[LongPlace]
) -> LongPlace:
    """The times of a long place taken now by a prompt of `uncached` tokens on a card of
    prefill `rate` (tokens/s) whose other long places of ours are `held`: its prefill
    starts once theirs end, and the place opens `share` of its prefill time before its
    first token is due. Without a rate (or behind a place not predicted) both are inf.

    >>> place(10.0, 6000, 20000.0, 0.15, [])
    LongPlace(due=10.3, opens=10.255, uncached=6000)
    >>> place(10.0, 6000, 20000.0, 0.15, [LongPlace(10.05, 10.005, 6000)]).due
    10.35
    """
    if not rate or share <= 0:
        return LongPlace(math.inf, math.inf, uncached)
    prefill = uncached / rate
    due = max([now, *(p.due for p in held)]) + prefill
    return LongPlace(round(due, 9), round(due - share * prefill, 9), uncached)


def opening(state: InstanceState, now: float) -> int:
    """The long places of ours on `state` open to the next prompt by now."""
    return sum(1 for p in state.long_places if p.opens <= now)


def ahead_of_next(state: InstanceState, now: float, rate: float | None) -> int:
    """Prompt tokens of ours that a prompt sent to `state` now waits behind: an open
    place counts only the part of its prefill predicted still to come."""
    pending = state.pending_prefill_tokens
    for p in state.long_places:
        if p.opens <= now and rate:
            pending -= p.uncached - min(p.uncached, round(max(0.0, p.due - now) * rate))
    return pending


def wake_at(states: Iterable[InstanceState], now: float) -> float | None:
    """The next time a place opens on any of `states` (None: none will before a first
    token comes back, which wakes the scheduler anyway)."""
    opens = (p.opens for s in states for p in s.long_places)
    return min((t for t in opens if now < t < math.inf), default=None)
