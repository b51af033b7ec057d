"""least_time: send each request where its predicted time is lowest, and keep short
answers out of long prefills (the class docstring has the model)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from . import speed
from .model import InstanceState, Lane, Ticket
from .select import lowest, score_all


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
        decode    = max_tokens x tpot                             (decode = "full")
                    max_tokens x max(0, tpot - the lane's TPOT objective)
                                                                  (decode = "over_objective")
        cost      = (ttft + stall + decode) x (1 + failures)

    With "over_objective" (the default; "full" measured worse, loadtest/README.md, lanes)
    decode counts only beyond the objective. With "full" the cost is the predicted
    end-to-end latency: decode time
    counts in proportion to the output, so it decides where the output is long enough to
    matter and not where it is not (a one-token answer is judged on TTFT alone); an
    instance whose steps are slowed by the long prefills it carries (its learned TPOT
    shows them) loses decode-heavy requests, so TTFT is not bought with end-to-end time.
    With "over_objective" an instance within the TPOT objective is judged on TTFT alone,
    and one slower pays for each token it would be late.
    A cached prefix is one term of the same cost, not a switch: it saves its prefill
    time where it is cached, and a hot prefix spreads to another instance once the work
    queued where it is cached outweighs what the cache saves.
    An instance without history is assumed to run at the fleet's median speed; with no
    history anywhere, at a nominal prior, which makes the choice "least prefill work
    queued". Ties break at random.
    """

    name = "least_time"
    # A short prompt's own predicted end-to-end may be this much above its best, and its
    # first token SHELTER_SLACK_S later, to go where long prefills are least likely to
    # stall it (see `_sheltered`).
    SHELTER_SLACK = 0.1  # share of the best
    SHELTER_SLACK_S = 0.02  # s, on top
    # A long prompt waits for a place about to free only where that cuts its cost by
    # more than this share (see `worth_waiting`).
    WAIT_GAIN = 0.5
    # The head of the long queue hands a slow card's place to the newest long prompt
    # where its own first token would come this much sooner on a card about to free
    # (see `sooner_elsewhere`): the prediction counts the whole prefill there as still
    # to do, so a fast card about to free shows about 0.8 of a 0.4-speed card's time.
    HAND_GAIN = 0.1
    PRIOR_PREFILL = 5000.0  # tokens/s
    PRIOR_TPOT = 0.03  # s
    DEFAULT_TPOT_OBJECTIVE = 0.1  # s, the [slo] default

    def __init__(
        self,
        stale_after: float,
        tpot_objectives: Mapping[Lane, float] | None = None,
        decode: Literal["full", "over_objective"] = "over_objective",
    ) -> None:
        self.stale_after = stale_after
        self.tpot_objectives = dict(tpot_objectives or {})
        self.decode = decode
        # Per lane, the time to first token a request should get ([slo]); none: no bound.
        self.ttft_objectives: dict[Lane, float] = {}

    def predict(
        self, state: InstanceState, fleet: Sequence[InstanceState], ticket: Ticket, now: float
    ) -> float:
        return self.costs([state], fleet, ticket, now)[state.name]

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
        prefill_median = speed.median(s.speed.prefill_rate for s in fleet) or self.PRIOR_PREFILL
        tpot_median = speed.median(s.speed.tpot_value for s in fleet) or self.PRIOR_TPOT
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
            # the instance that holds the prefix (the fleet computes the prefix twice); and
            # charged only once, a long prompt went where it would start soonest however
            # many answers its prefill would stall there (`loadtest lanes`: short p50
            # end-to-end 957 against 753 ms at 75% of capacity, one run).
            crowd = state.fleet_inflight + loads[state.name].others
            stall = uncached / rate * crowd
            queued = state.fleet_inflight - state.spec.slots
            if queued >= 0:
                ttft += (queued + 1) * max(1, ticket.max_tokens) * tpot / state.spec.slots
            if self.decode == "full":
                decode = ticket.max_tokens * tpot
            else:
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
        without this bound a long prompt queued behind two prefills on a card with few
        answers running rather than start at once on a busier one (`loadtest compare`:
        p99 TTFT 0.77-1.14 s against 0.66-0.80 s before the stall was counted per answer).
        """
        return [c for c in candidates if self._on_time(predicted[c.name], lane)] or candidates

    def _on_time(self, predicted: Prediction, lane: Lane) -> bool:
        """Whether its first token comes within its lane's TTFT objective (if it has one)."""
        objective = self.ttft_objectives.get(lane)
        return objective is None or predicted.ttft <= objective

    def _sheltered(
        self, candidates: Sequence[InstanceState], predicted: Mapping[str, Prediction]
    ) -> Sequence[InstanceState]:
        """Of the candidates where a short prompt's own end-to-end is near its best, those
        with the most requests in flight: where the next long prefill is least likely to
        land, since a long prompt goes where its prefill stalls the fewest answers.

        A short answer decoding when a 6,000-token prefill lands on its card waits 0.3 s
        for one token. Spread evenly, 47-59% of them met at least one, so their median
        sat on that edge (`loadtest lanes`, issue 10's mix: 0.70-0.94 s from run to run);
        sheltered, 0.48-0.81 s. One more sequence in a decode step costs the
        others about 2%, so packing short prompts where others run costs them little,
        and the long prompts avoid that card the more the fuller it is: a card for the
        short lane forms by itself, moves when the traffic does, and takes long prompts
        again when the others are full.
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

    def worth_waiting(
        self,
        candidates: Sequence[InstanceState],
        freeing: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
    ) -> bool:
        """Whether a long prompt should wait for a long place to free on one of `freeing`
        (each prefilling a long prompt now) rather than start now on one of `candidates`.

        It waits where that costs less than half, its wait included: a card prefilling
        behind few answers beats an idle one where many decode, since its prefill would
        stall each of them (the short prompts gather there, `_sheltered`). Only within
        its TTFT objective. The wait is certain and the stall it saves a prediction, so
        a small saving does not buy it: on an even fleet where every card has a dozen
        answers decoding, waiting wherever it cut the cost by a quarter put the long p99
        TTFT 35% above least_busy's for no goodput; by half, 8% (`loadtest lanes`).
        """
        predicted, soon = self._now_and_soon(candidates, freeing, fleet, ticket, now)
        if not soon:
            return False
        start = self._in_time(candidates, predicted, ticket.lane)
        best_now = min(predicted[c.name].cost for c in start)
        return min(p.cost for p in soon) < (1 - self.WAIT_GAIN) * best_now

    def sooner_elsewhere(
        self,
        candidates: Sequence[InstanceState],
        freeing: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
    ) -> bool:
        """Whether `ticket`'s first token comes sooner, by more than HAND_GAIN, on a
        card about to free (and within its TTFT objective there) than on any of
        `candidates` now. The scheduler asks for the head of the long queue when the
        places now are all on slow cards: if so, the newest long prompt takes the place,
        and the head, which has waited longest, the fast one about to free."""
        predicted, soon = self._now_and_soon(candidates, freeing, fleet, ticket, now)
        best_now = min(predicted[c.name].ttft for c in candidates)
        return bool(soon) and min(p.ttft for p in soon) < (1 - self.HAND_GAIN) * best_now

    def _now_and_soon(
        self,
        candidates: Sequence[InstanceState],
        freeing: Sequence[InstanceState],
        fleet: Sequence[InstanceState],
        ticket: Ticket,
        now: float,
    ) -> tuple[dict[str, Prediction], list[Prediction]]:
        """Predictions on every card, in one pass (the fleet's loads and medians once),
        and those of the `freeing` cards where its first token comes within objective."""
        predicted = self._predict([*candidates, *freeing], fleet, ticket, now)
        soon = [predicted[f.name] for f in freeing if self._on_time(predicted[f.name], ticket.lane)]
        return predicted, soon

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
