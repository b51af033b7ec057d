"""A breather after each long prefill: the card's answers decode before the next one.

Why: a 6,000-token prefill is one engine step of 0.3 s on a speed-1 card, and every
answer running there waits that step for its next token. With a queue of long prompts
and one long place per card (`max_long_per_instance = 1`), the place frees at the first
token and the next long prompt starts at once: the card prefills back to back, and its
answers get one token per prefill. A 32-token answer meant to keep within a 50 ms TPOT
has about 1.1 s of stall to spend over its 31 steps; three or four prefills use it up.

So after a long prefill ends on a card that serves both lanes and has answers running,
its long place stays closed for `long_prefill_gap` times that prefill's time (its
uncached tokens at the card's learned rate), during which the card runs decode steps
only: with a gap of 0.3 of a 0.3 s prefill, about seven steps of 13 ms. The cost is
the card's long throughput during a burst: it prefills at most 1 / (1 + gap) of the
time.

The breather is never a refusal and never long: a long request that has already waited
in the gateway queue as long as the gap takes the place at once. On a saturated fleet
every queued request has waited that long, so the gap stops binding where the card's
time is wanted most; at lighter load it only makes a long prompt that arrives just as a
prefill ends wait out the rest of the gap, or go to another card.
"""

from __future__ import annotations

from collections.abc import Iterable

from .model import InstanceState


def gap_after(uncached: int, prefill_rate: float | None, share: float) -> float:
    """How long a card's long place stays closed after a prefill of `uncached` tokens
    there: `share` of the prefill's time at the card's learned rate (0: no rate yet).

    >>> gap_after(6000, 20000.0, 0.3)
    0.09
    """
    if share <= 0 or not prefill_rate:
        return 0.0
    return round(share * uncached / prefill_rate, 9)


def holds(state: InstanceState, queued_since: float | None, now: float) -> bool:
    """Whether `state`'s breather keeps a long request out now: it is open, answers run
    there, and the request (queued since `queued_since`; None: not queued) has not yet
    waited as long as the gap in the gateway queue."""
    if state.long_gap_until <= now or state.fleet_inflight == 0:
        return False
    return queued_since is None or now < queued_since + state.long_gap


def wake_at(
    states: Iterable[InstanceState], longest_wait_since: float | None, now: float
) -> float | None:
    """When a breather next stops holding the long request that has waited longest
    (queued since `longest_wait_since`; None: no long request waits): the end of the
    gap, or when that request will have waited as long as the gap. None: nothing to
    wake for."""
    if longest_wait_since is None:
        return None
    ends = [min(s.long_gap_until, longest_wait_since + s.long_gap) for s in states]
    return min((end for end in ends if end > now), default=None)
