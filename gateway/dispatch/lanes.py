"""The dynamic split of the shared instances between the short and the long lane.

Why: on an instance that serves both lanes, every short prompt shares its engine steps
with the long prompts prefilling there (vLLM's chunked prefill batches them together),
so its time to first token and each of its decode steps pay for a long prefill. That is
the prefill/decode interference DistServe is about. `max_long_per_instance` bounds the
damage but spreads it over the whole fleet. Instead, each `lane = "any"` instance is
held by one lane at a time: short requests go to the short-held ones, long requests to
the long-held ones. A long request spills to a short-held instance only when no
long-held one is up, or when admission would refuse it for its wait (and
`max_long_per_instance` caps it there); a short request spills to a long-held one when
none of its own has a free running slot and that one has (`prefer`).

How the split is sized: the work each lane asked for over the last `WINDOW` seconds
(uncached prompt tokens, plus its output tokens counted at what a decode token costs in
prefill tokens on a full batch), against each lane's capacity (the sum of its available
instances' prefill rates). The split minimises the busier lane's load, work / capacity.
Static `short` and `long` instances count toward their lane's capacity and never move.

Which prefill rate: `InstanceState.speed` learns one from every first token, but a short
prompt's first token also waits for its engine step's fixed cost (the decode of every
running sequence), so an instance serving short prompts looks several times slower than
one serving long prompts on the same card; sized by those rates, the split would hand
the short lane more and more instances. So the split learns its own rate from bulk
samples only, `BULK_TOKENS` or more of prefill work (the prompt and the work ahead of
it), where the fixed cost is a few per cent. An instance without a bulk sample counts at
the median bulk rate scaled by its learned speed relative to the others (else its
weight); with no bulk sample anywhere, the learned rates; with nothing learned, weights.

Hysteresis: one evaluation per health round proposes at most one move (one instance to
the other lane, or two swapped between the lanes), and only if it cuts the busier lane's
load by `MARGIN`; the same proposal must come `CONFIRM` evaluations in a row before it
is made. Since every move strictly lowers a fixed objective, a steady mix never flaps: a
move back would raise it.
A lane with traffic never gives up its last available instance (its load would be
infinite); a lane without traffic in the window gives its instances to the other one,
one per confirmation. Before any traffic, every shared instance is held by the short
lane, and a long request spills there under `max_long_per_instance`: today's behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import speed
from .model import InstanceLane, InstanceState, Lane

WINDOW = 30.0  # seconds of assignments the mix is measured over
BULK_TOKENS = 2048  # prefill samples this large teach the split an instance's rate
BULK_WEIGHT = 0.2  # of each new bulk sample in the moving average
BUCKETS = 15  # the window slides in steps of WINDOW / BUCKETS
MARGIN = 0.1  # a move must cut the busier lane's load by at least this share
CONFIRM = 2  # evaluations in a row that must propose the same move
# Priors while the fleet has no history (the same as least_time's).
PRIOR_PREFILL = 5000.0  # tokens/s
PRIOR_TPOT = 0.03  # s


@dataclass(frozen=True)
class Move:
    """Instances and the lanes they go to: one, or two swapped between the lanes."""

    changes: tuple[tuple[str, Lane], ...]


@dataclass(frozen=True)
class Mix:
    """The work each lane asked for in the window: prompt and output tokens."""

    prompt: dict[Lane, float]
    output: dict[Lane, float]


def _other(lane: Lane) -> Lane:
    return Lane.LONG if lane is Lane.SHORT else Lane.SHORT


class LaneSplit:
    """Which lane holds each shared instance, and the window that sizes the split.

    `enabled = False` keeps every shared instance serving both lanes (the split off).
    """

    def __init__(self, states: Iterable[InstanceState], enabled: bool = True) -> None:
        self.enabled = enabled
        self._held = {s.name: Lane.SHORT for s in states if s.spec.lane == "any"}
        # bucket number (start time // width) -> [short prompt, short output, long prompt,
        # long output] tokens.
        self._buckets: dict[int, list[float]] = {}
        self._width = WINDOW / BUCKETS
        self._pending: Move | None = None
        self._streak = 0
        self._bulk: dict[str, float] = {}  # prefill rates from bulk samples, tokens/s

    def set_fleet(self, states: Iterable[InstanceState], enabled: bool) -> None:
        """A reloaded instance list: shared instances that stay keep their lane and rates,
        new ones start short, removed (or now static) ones are forgotten."""
        self.enabled = enabled
        states = list(states)
        names = {s.name for s in states}
        shared = [s.name for s in states if s.spec.lane == "any"]
        self._held = {name: self._held.get(name, Lane.SHORT) for name in shared}
        self._bulk = {n: r for n, r in self._bulk.items() if n in names}
        self._pending, self._streak = None, 0

    # ------------------------------------------------------------ queries

    def lane(self, state: InstanceState) -> InstanceLane:
        """The lane `state` serves now: its static lane, its held lane, or "any" (split off)."""
        if state.spec.lane != "any" or not self.enabled:
            return state.spec.lane
        return self._held.get(state.name, Lane.SHORT).value

    def prefer(
        self, pool: Sequence[InstanceState], lane: Lane, up: Sequence[InstanceState]
    ) -> list[InstanceState]:
        """Where a `lane` request may go, of the instances in `pool` (all with room);
        `up` is every instance it could use, with room or not.

        Its own lane's instances, if any has room. A short request also spills when none
        of its own has a free running slot and one of the long lane's has: it runs at once
        there, and its short prefill costs the long prompts little. A long request never
        spills while an instance of its own lane is up: it waits in the gateway queue for
        the first place there, since its prefill would stall every short sequence on a
        short-held instance (the split, not the spill, gives the long lane more cards).
        Only a request that admission would refuse for its wait is lent the other lane's
        place (`Fleet._spill_candidates`): served there beats refused.
        """
        own = [s for s in pool if self.lane(s) in (lane.value, "any")]
        if lane is Lane.LONG:
            if own or any(self.lane(s) == "long" for s in up):
                return own
            return list(pool)
        if not own or len(own) == len(pool) or any(_free(s) for s in own):
            return own or list(pool)
        return [s for s in pool if s not in own and _free(s)] or own

    def capped(self, state: InstanceState) -> bool:
        """Whether long requests there are bounded by `max_long_per_instance`: on every
        shared instance, whichever lane it holds (a static `long` one is not bounded).

        On a long-held instance the cap is what keeps long prompts in one gateway queue:
        uncapped, each commits on arrival to the card with the fewest requests and may
        wait behind a queue of prefills there while another card frees first (measured:
        long p99 TTFT 3.4 s against 1.6 s with the cap, `loadtest lanes`). Capped, the
        few prefilling there fill its step budget and the rest go to the first card free.
        """
        return state.spec.lane == "any"

    def observe_prefill(self, name: str, tokens: int, seconds: float) -> None:
        """A first token came `seconds` after sending, with `tokens` of prefill work (its
        own and what was ahead of it); only bulk samples teach the split's rates."""
        if self.enabled and tokens >= BULK_TOKENS and seconds > 0:
            # A plain moving average: unlike least_time's, which believes a slowdown at
            # once, it must not keep one unlucky sample on an instance that then serves
            # short prompts and takes no more bulk samples to correct it.
            sample = tokens / seconds
            old = self._bulk.get(name)
            self._bulk[name] = sample if old is None else old + BULK_WEIGHT * (sample - old)

    def rates(self) -> dict[str, float]:
        """The bulk prefill rates learned so far, tokens/s."""
        return dict(self._bulk)

    # ------------------------------------------------------------ the window

    def record(self, lane: Lane, prompt_tokens: int, max_tokens: int, now: float) -> None:
        """A request of `lane` was sent with this much uncached prompt and output asked."""
        if not self.enabled:
            return
        bucket = self._buckets.setdefault(math.floor(now / self._width), [0.0] * 4)
        base = 0 if lane is Lane.SHORT else 2
        bucket[base] += prompt_tokens
        bucket[base + 1] += max_tokens
        if len(self._buckets) > 2 * BUCKETS:  # a long gap between evaluations
            self._trim(now)

    def _trim(self, now: float) -> None:
        oldest = math.floor((now - WINDOW) / self._width)
        for key in [k for k in self._buckets if k <= oldest]:
            del self._buckets[key]

    def mix(self, now: float) -> Mix:
        """The work each lane asked for over the last `WINDOW` seconds."""
        self._trim(now)
        sums = [sum(b[i] for b in self._buckets.values()) for i in range(4)]
        return Mix(
            prompt={Lane.SHORT: sums[0], Lane.LONG: sums[2]},
            output={Lane.SHORT: sums[1], Lane.LONG: sums[3]},
        )

    # ------------------------------------------------------------ the split

    def evaluate(self, states: Sequence[InstanceState], now: float) -> dict[str, Lane]:
        """One health round's look at the mix: the instances moved now (none, one, or
        two swapped)."""
        if not self.enabled or not self._held:
            return {}
        proposal = propose(states, dict(self._held), self.mix(now), now, self.rates())
        if proposal is None or proposal != self._pending:
            self._pending, self._streak = proposal, 0
        if proposal is None:
            return {}
        self._streak += 1
        if self._streak < CONFIRM:
            return {}
        self._held.update(proposal.changes)
        self._pending, self._streak = None, 0
        return dict(proposal.changes)

    def held(self) -> dict[str, Lane]:
        return dict(self._held)

    def __repr__(self) -> str:
        held = " ".join(f"{name}={lane.value}" for name, lane in self._held.items())
        return f"<LaneSplit {'on' if self.enabled else 'off'} {held}>"


def _free(state: InstanceState) -> bool:
    """Whether it has a running slot free of our requests (one more would not queue)."""
    return state.fleet_inflight < state.spec.slots


def capacities(
    states: Sequence[InstanceState], bulk: dict[str, float] | None = None
) -> dict[str, float]:
    """Each instance's prefill rate, in one unit for all: its bulk rate, else the median
    bulk rate scaled by its learned speed relative to the instances with one, else by its
    weight; with no bulk rate anywhere, the same from the learned rates; with nothing
    learned, its weight."""
    rates = bulk or {}
    learned = {s.name: v for s in states if (v := s.speed.prefill_rate) is not None}
    if not rates:
        rates = learned
    median = speed.median(rates.values()) or 1.0
    # Without a rate of its own, an instance counts at the median times its speed
    # relative to the instances with one (from the learned rates), else its weight.
    ref = speed.median(v for n, v in learned.items() if n in rates)
    out = {}
    for s in states:
        if s.name in rates:
            out[s.name] = rates[s.name]
        elif ref and s.name in learned:
            out[s.name] = median * learned[s.name] / ref
        else:
            out[s.name] = median * s.spec.weight
    return out


def work(
    states: Sequence[InstanceState], mix: Mix, caps: dict[str, float] | None = None
) -> dict[Lane, float]:
    """Each lane's work in prompt tokens: an output token on a full batch costs what
    one engine step's share of a sequence costs, tpot / slots, in prefill tokens."""
    rates = capacities(states, caps)
    median = speed.median(rates.values()) or 1.0
    learned = bool(caps) or any(s.speed.prefill_rate is not None for s in states)
    rate = median if learned else PRIOR_PREFILL  # nothing learned: rates are bare weights
    # The least interfered decode (on the instance whose steps carry the least prefill),
    # scaled to a median-speed card.
    tpot = min(
        (v * rates[s.name] / median for s in states if (v := s.speed.tpot_value) is not None),
        default=PRIOR_TPOT,
    )
    slots = speed.median(float(s.spec.slots) for s in states) or 1.0
    per_output = tpot / slots * rate
    return {lane: mix.prompt[lane] + per_output * mix.output[lane] for lane in Lane}


def load(
    states: Sequence[InstanceState],
    held: dict[str, Lane],
    demand: dict[Lane, float],
    caps: dict[str, float],
    now: float,
) -> float:
    """The busier lane's work / capacity (infinite where a lane with work has none)."""
    worst = 0.0
    for lane in Lane:
        if demand[lane] <= 0:
            continue
        cap = sum(
            caps[s.name]
            for s in states
            if s.available(now) and (s.spec.lane == lane.value or held.get(s.name) is lane)
        )
        worst = max(worst, demand[lane] / cap if cap > 0 else math.inf)
    return worst


def propose(
    states: Sequence[InstanceState],
    held: dict[str, Lane],
    mix: Mix,
    now: float,
    bulk: dict[str, float] | None = None,
) -> Move | None:
    """The one move that best lowers the busier lane's load, if worth making: one
    instance to the other lane, or two swapped between the lanes.

    Pure: a function of the instances' speeds and availability, who holds what, and the
    mix. A lane with no work gives its instances away (the fastest first); otherwise a
    move must cut the busier lane's load by `MARGIN`. A swap keeps both lanes' sizes and
    trades a faster instance for a slower one: it gets the split out of a spot that no
    single move improves (the slow card in the long lane, a fast one in the short).
    """
    caps = capacities(states, bulk)
    demand = work(states, mix, bulk)
    if all(w <= 0 for w in demand.values()):
        return None
    movable = [s for s in states if s.name in held and s.available(now)]  # static, down: no
    Changes = tuple[tuple[str, Lane], ...]
    best: tuple[float, float, Changes] | None = None
    for s in movable:
        to = _other(held[s.name])
        if demand[to] <= 0:
            continue  # a lane without traffic needs no instance
        after = load(states, {**held, s.name: to}, demand, caps, now)
        # Lowest load after the move; among equals the fastest instance; then by name.
        single: Changes = ((s.name, to),)
        key = (after, -caps[s.name], single)
        if best is None or key < best:
            best = key
    if best is not None and demand[_other(best[2][0][1])] <= 0:
        return Move(best[2])  # from a lane without traffic: no margin needed
    if all(w > 0 for w in demand.values()):
        shorts = [s for s in movable if held[s.name] is Lane.SHORT]
        longs = [s for s in movable if held[s.name] is Lane.LONG]
        for a in shorts:
            for b in longs:
                if caps[a.name] == caps[b.name]:
                    continue  # swapping equals changes nothing
                changes: Changes = ((a.name, Lane.LONG), (b.name, Lane.SHORT))
                after = load(states, {**held, **dict(changes)}, demand, caps, now)
                key = (after, 0.0, changes)
                if best is None or key < best:
                    best = key
    if best is None:
        return None
    if best[0] < load(states, held, demand, caps, now) * (1 - MARGIN):
        return Move(best[2])
    return None
