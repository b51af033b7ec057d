"""Strategies: given the instances that may take a request now, pick one.

The candidates reaching a strategy are already filtered: available, serving the lane,
with room under their limits. A strategy only ranks them. This module has the load
scores and the two simple strategies; `least_time` (predicted time) is least_time.py,
and strategies.py names them all.

`least_busy` scores each instance (lower is better):

    own      = requests this gateway has in flight there (exact, instant)
    peers    = requests the other gateway processes have there (the shared view, if any)
    others   = running + waiting that the instance reported in its last /metrics scrape,
               minus the gateways' requests it was running then (traffic that bypasses us)
    kv       = its reported KV-cache usage, 0..1
    score    = (own + peers + others) / weight + kv + failures - affinity
    affinity = AFFINITY x the share of the prompt estimated cached there (0..1)

A report older than `metrics_stale_after` (or none yet) is unknown, not idle: its
`others` and `kv` are taken as the highest any instance with a fresh report shows, so
an instance nobody has measured never looks like the emptiest. `failures` is the count
of consecutive failed requests, so a backend that fails fast does not attract traffic
by looking idle. The affinity term is worth at most one request in flight: it decides
between instances about equally loaded and never overrides a real imbalance. Ties break
at random.

A long prompt (the long lane) cached nowhere is first narrowed to the instances with a
running slot free and, of those, the least prefill work before its first token
(`least_prefill_work`); the score decides among them. Its wait is the prefills ahead,
which a count of requests does not see. A short prompt cached nowhere is first narrowed
to the instances with the fewest long prompts in prefill (`clear_of_long_prefills`):
behind one it waits for the long prompt's chunks, which a count of requests does not see
either.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .disaggregation import predicted_prefill
from .model import InstanceState, Lane, Ticket
from .speed import median

_TIE = 1e-9
# least_busy: a prompt fully cached on an instance is worth one request less there.
AFFINITY = 1.0


@dataclass(frozen=True)
class Score:
    own: int
    peers: int
    others: float
    kv: float
    failures: int
    weight: float
    fresh: bool

    @property
    def total(self) -> float:
        return (self.own + self.peers + self.others) / self.weight + self.kv + self.failures


def _fresh_load(state: InstanceState, now: float, stale_after: float) -> tuple[float, float] | None:
    report = state.fresh_report(now, stale_after)
    if report is None:
        return None
    others = max(0.0, report.running + report.waiting - state.inflight_at_report)
    return others, report.kv_usage or 0.0


def score_all(states: Sequence[InstanceState], now: float, stale_after: float) -> dict[str, Score]:
    """Score every instance in `states`, filling unknown loads pessimistically."""
    fresh = {s.name: _fresh_load(s, now, stale_after) for s in states}
    known = [load for load in fresh.values() if load is not None]
    worst_others = max((o for o, _ in known), default=0.0)
    worst_kv = max((k for _, k in known), default=0.0)
    scores = {}
    for s in states:
        load = fresh[s.name]
        others, kv = load if load is not None else (worst_others, worst_kv)
        scores[s.name] = Score(
            own=s.inflight,
            peers=s.peers.inflight,
            others=others,
            kv=kv,
            failures=s.consecutive_failures,
            weight=s.spec.weight,
            fresh=load is not None,
        )
    return scores


def lowest(
    candidates: Sequence[InstanceState], costs: dict[str, float], rng: random.Random
) -> InstanceState:
    """The candidate with the lowest cost; ties (within rounding) broken at random."""
    best = min(costs[c.name] for c in candidates)
    ties = [c for c in candidates if costs[c.name] <= best * (1 + _TIE) + _TIE]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def least_prefill_work(candidates: Sequence[InstanceState]) -> list[InstanceState]:
    """The candidates where the least prefill work stands before a long prompt's first
    token: the uncached prompt tokens of ours and the peers' still short of their first
    token there, over the instance's weight; of those with a running slot free, if any
    (a full one would queue it behind a whole decode).

    A long prompt's first token waits for the prefills ahead of it, not for the requests
    decoding there (each takes one token of a step's budget): counted in requests, an
    instance with a long prompt prefilling and one request decoding looks less busy than
    one with three decoding and nothing to prefill. Only for a prompt cached nowhere:
    where it is cached, least_busy's bounded affinity term decides (placed by work too,
    the prefix workload lost goodput: docs/decisions/0016).
    """
    free = [c for c in candidates if c.total_inflight < c.slots]
    candidates = free or candidates
    work = {
        c.name: (c.pending_prefill_tokens + c.peers.pending_prefill_tokens) / c.spec.weight
        for c in candidates
    }
    least = min(work.values(), default=0.0)
    return [c for c in candidates if work[c.name] <= least]


def clear_of_long_prefills(
    candidates: Sequence[InstanceState], ticket: Ticket
) -> list[InstanceState]:
    """The candidates with the fewest long prompts in prefill (ours and the peers'); when
    every one holds some, those where `ticket`'s prefill is predicted to finish first.

    vLLM's scheduler serves the running requests first, a long prompt's next prefill chunk
    among them, so a short prompt that arrives behind it waits for its chunks before its
    own first token: on a card at 0.4x, most of a second for a 6,000-token prompt. Counted
    in requests the long prompt is one like any other; here it keeps the short prompts
    away while another card can take them, and otherwise sends them where the prefills
    ahead clear first (a slow card's at its own learned rate).
    """
    longs = {c.name: c.long_prefilling + c.peers.long_prefilling for c in candidates}
    fewest = min(longs.values(), default=0)
    clear = [c for c in candidates if longs[c.name] <= fewest]
    if not fewest or len(clear) < 2:
        return clear
    rate = median(c.speed.prefill_rate for c in clear)
    finish = {c.name: predicted_prefill(c, ticket, rate) for c in clear}
    first = min(finish.values())
    return [c for c in clear if finish[c.name] <= first]


class LeastBusy:
    name = "least_busy"

    def __init__(
        self, stale_after: float, tpot_objectives: Mapping[Lane, float] | None = None
    ) -> None:
        self.stale_after = stale_after

    def choose(
        self,
        candidates: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
        rng: random.Random,
    ) -> InstanceState:
        # Each candidate's prefix match once: it decides the long-prompt rule and the
        # affinity term.
        cached = {c.name: c.cached_tokens(ticket) for c in candidates} if ticket.prefix else {}
        if not any(cached.values()):  # a cached prompt is the affinity term's (0016)
            if ticket.lane is Lane.LONG:
                candidates = least_prefill_work(candidates)
            else:
                candidates = clear_of_long_prefills(candidates, ticket)
        # Unknown loads borrow from the whole fleet's fresh reports, not just candidates'.
        scores = score_all(fleet, now, self.stale_after)
        costs = {c.name: scores[c.name].total for c in candidates}
        if cached and ticket.tokens:
            for c in candidates:
                costs[c.name] -= AFFINITY * cached[c.name] / ticket.tokens
        return lowest(candidates, costs, rng)


class RoundRobin:
    name = "round_robin"

    def __init__(
        self, stale_after: float, tpot_objectives: Mapping[Lane, float] | None = None
    ) -> None:
        self._next = 0

    def choose(
        self,
        candidates: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
        rng: random.Random,
    ) -> InstanceState:
        # Walk the whole fleet's order so skipping a full instance does not skew the cycle.
        names = {c.name for c in candidates}
        for step in range(len(fleet)):
            state = fleet[(self._next + step) % len(fleet)]
            if state.name in names:
                self._next = (self._next + step + 1) % len(fleet)
                return state
        raise ValueError("choose() needs at least one candidate")

    def __repr__(self) -> str:
        return f"<RoundRobin next={self._next}>"
