"""least_time: send each request where its predicted time is lowest, and keep short
answers out of long prefills (the class docstring has the model)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .model import InstanceState, Lane, Ticket
from .select import lowest, score_all
from .speed import median


class Prediction(NamedTuple):
    """What least_time predicts of a request on one instance."""

    ttft: float  # its own time to first token
    cost: float  # what it decides by: its time plus the stall it adds for others
    latency: float  # its own end-to-end: ttft + max_tokens x tpot
    crowd: float  # requests in flight there (ours, peers', others'): what a prefill stalls


def longs_running(fleet: Sequence[InstanceState]) -> bool:
    """Whether any long request holding a long place (ours or a peer's) is not fully
    answered yet: its card's next long prefill may stall short answers."""
    return any(s.long_running + s.peers.long_running > 0 for s in fleet)


class LeastTime:
    """Send each request where its predicted time to first token is lowest.

    For each candidate, with its learned prefill rate (tokens/s) and TPOT:

        cached    = this prompt's tokens estimated in its prefix cache (affinity.py)
        uncached  = prompt tokens - cached
        ahead     = uncached prompt tokens of ours (and peers') still in prefill there
                    + others' requests (from /metrics) x uncached
        slot_wait = when all its slots are taken: (queued + 1) x max_tokens x tpot / slots
        stall     = uncached / prefill rate x the requests in flight there (ours,
                    peers', others'): the delay its prefill adds to each of them
        ttft      = (ahead + uncached) / prefill rate + slot_wait
        decode    = max_tokens x max(0, tpot - the lane's TPOT objective)
        cost      = (ttft + stall + decode) x (1 + failures)

    An instance within the TPOT objective is judged on TTFT and stall alone, and one
    slower pays for each token it would be late.
    A cached prefix is one term of the same cost, not a switch: it saves its prefill
    time where it is cached, and a hot prefix spreads to another instance once the work
    queued where it is cached outweighs what the cache saves.
    An instance without history is assumed to run at the fleet's median speed; with no
    history anywhere, at a nominal prior, which makes the choice "least prefill work
    queued". Ties break at random.
    """

    name = "least_time"
    # `_sheltered`: a short prompt's end-to-end may be this share above its best, and its
    # first token SHELTER_SLACK_S later (measured in lanes Round 4: docs/decisions/0005).
    SHELTER_SLACK = 0.1
    SHELTER_SLACK_S = 0.02  # s
    PRIOR_PREFILL = 5000.0  # tokens/s
    PRIOR_TPOT = 0.03  # s
    DEFAULT_TPOT_OBJECTIVE = 0.1  # s, the [slo] default

    def __init__(
        self,
        stale_after: float,
        tpot_objectives: Mapping[Lane, float] | None = None,
    ) -> None:
        self.stale_after = stale_after
        self.tpot_objectives = dict(tpot_objectives or {})
        # Per lane, the time to first token a request should get ([slo]); none: no bound.
        self.ttft_objectives: dict[Lane, float] = {}

    def costs(
        self,
        candidates: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
    ) -> dict[str, float]:
        return {n: p.cost for n, p in self._predict(candidates, fleet, ticket, now).items()}

    def _predict(
        self,
        candidates: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
    ) -> dict[str, Prediction]:
        """Per candidate: what the request would get there, and what it would cost."""
        prefill_median = median(s.speed.prefill_rate for s in fleet) or self.PRIOR_PREFILL
        tpot_median = median(s.speed.tpot_value for s in fleet) or self.PRIOR_TPOT
        objective = self.tpot_objectives.get(ticket.lane, self.DEFAULT_TPOT_OBJECTIVE)
        loads = score_all(fleet, now, self.stale_after)
        out: dict[str, Prediction] = {}
        for state in candidates:
            rate = state.speed.prefill_rate or prefill_median
            tpot = state.speed.tpot_value or tpot_median
            uncached = ticket.tokens - state.cached_tokens(ticket)
            # Others' requests (traffic we did not send, or a scrape that lags ours) are
            # taken at this request's uncached size there: counting each as a whole prompt
            # would let one phantom request outweigh a cached prefix's saving.
            ahead = (
                state.pending_prefill_tokens
                + state.peers.pending_prefill_tokens
                + loads[state.name].others * uncached
            )
            ttft = (ahead + uncached) / rate
            # What its prefill costs the requests already there: each of them waits for it
            # once more (batched with it or behind it), so the stall counts once per
            # request in flight. Without it a miss looks no dearer than a short queue at
            # the instance that holds the prefix (the fleet computes the prefix twice), and
            # a long prompt goes where it would start soonest however many answers its
            # prefill would stall there.
            crowd = state.total_inflight + loads[state.name].others
            stall = uncached / rate * crowd
            queued = state.total_inflight - state.slots
            if queued >= 0:
                ttft += (queued + 1) * max(1, ticket.max_tokens) * tpot / state.slots
            decode = ticket.max_tokens * max(0.0, tpot - objective)
            cost = (ttft + stall + decode) * (1 + state.consecutive_failures)
            latency = ttft + ticket.max_tokens * tpot
            out[state.name] = Prediction(ttft, cost, latency, crowd)
        return out

    def _in_time(
        self, candidates: Sequence[InstanceState], predicted: Mapping[str, Prediction], lane: Lane
    ) -> Sequence[InstanceState]:
        """The candidates where the request's own first token comes within its lane's
        TTFT objective; all of them if none does, or with no objective.

        The stall it adds for others never sends a request where its own first token
        would come later than its objective while another candidate would be in time:
        else a long prompt queues behind prefills on a card with few answers running rather
        than start at once on a busier one.
        """
        objective = self.ttft_objectives.get(lane)
        if objective is None:
            return candidates
        return [c for c in candidates if predicted[c.name].ttft <= objective] or candidates

    def _sheltered(
        self, candidates: Sequence[InstanceState], predicted: Mapping[str, Prediction]
    ) -> Sequence[InstanceState]:
        """Of the candidates where a short prompt's own end-to-end is near its best, those
        with the most requests in flight: where the next long prefill is least likely to
        land, since a long prompt goes where its prefill stalls the fewest answers.

        A short answer decoding when a long prefill lands on its card waits the whole
        prefill for its next token, while one more sequence in a decode step costs the
        others little. So short prompts pack where others run, and long prompts avoid that
        card the more the fuller it is: a card for the short lane forms by itself, moves
        when the traffic does, and takes long prompts again when the others are full.
        """
        best = min(predicted[c.name].latency for c in candidates)
        first = min(predicted[c.name].ttft for c in candidates)
        near = [
            c
            for c in candidates
            if predicted[c.name].latency <= best * (1 + self.SHELTER_SLACK) + self.SHELTER_SLACK_S
            and predicted[c.name].ttft <= first + self.SHELTER_SLACK_S
        ]
        if not near:  # the quickest first token and the quickest answer are far apart
            return candidates
        most = max(predicted[c.name].crowd for c in near)
        return [c for c in near if predicted[c.name].crowd >= most]

    def choose(
        self,
        candidates: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
        rng: random.Random,
    ) -> InstanceState:
        predicted = self._predict(candidates, fleet, ticket, now)
        candidates = self._in_time(candidates, predicted, ticket.lane)
        if ticket.lane is Lane.SHORT and longs_running(fleet):
            candidates = self._sheltered(candidates, predicted)
        return lowest(candidates, {n: p.cost for n, p in predicted.items()}, rng)
