"""Who of the long queue takes a place now, under least_time.

A long request that could start now may do better a moment later: its prefill stalls
every answer decoding where it lands, and a slow card takes longer to its first token.
Two choices, both made when a place is there for the head of the long queue (other
strategies always start it):
- With nobody of its lane and model queued behind it, it waits for a long place about
  to free where that halves its cost, the wait included (`LeastTime.worth_waiting`).
- With a queue behind it, every place is wanted and waiting would cost throughput. But
  where the places now are all on cards flagged slow (`speed.slow`) and its first token
  would come sooner, and within its TTFT objective, on a card about to free
  (`LeastTime.sooner_elsewhere`), the newest long request takes the slow place (with
  several, the newest first), and the head, which has waited longest, waits for the
  other, which it gets as it frees unless a retry or another gateway process takes it
  first. The slow place is used as soon as without the swap. The newest goes only
  where it may itself and before its deadline (the scheduler checks); the head still
  starts wherever it can once its queue wait runs out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .least_time import LeastTime
from .model import InstanceState, Lane, Ticket
from .strategies import Strategy


def who_starts(
    judge: Strategy,
    ticket: Ticket,
    youngest: Ticket | None,
    candidates: Sequence[InstanceState],
    freeing: Callable[[], Sequence[InstanceState]],
    fleet: Sequence[InstanceState],
    now: float,
) -> Ticket | None:
    """`ticket` (the head), `youngest` (the newest queued behind it, None if none) or
    nobody (None: the head waits) takes a place on `candidates` now. `judge` is the
    scheduler's strategy; `freeing` the cards where a long place frees when the prefill
    there ends (called only when needed: it walks the fleet)."""
    if ticket.lane is not Lane.LONG or ticket.exclude or not isinstance(judge, LeastTime):
        return ticket
    if youngest is not None and not all(c.speed.slow for c in candidates):
        return ticket
    if not (soon := freeing()):
        return ticket
    judged = (candidates, soon, fleet, ticket, now)
    if youngest is None:
        return None if judge.worth_waiting(*judged) else ticket
    return youngest if judge.sooner_elsewhere(*judged) else ticket
