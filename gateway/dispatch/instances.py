"""The instances a scheduler dispatches to (the fleet), by name and by lane.

The scheduler's `Instances` (`Scheduler.instances`): it holds the instance states, answers
questions about them (is one up, does it serve a model, has it room for a request, where
may a ticket go), counts a placed prompt into their prefix indexes, and takes in what the
shell observes of them that places no request (speeds, scrapes, other processes'
placements). It never sees a queue or a ticket's life: those are the scheduler's.
`apply` swaps in a new instance list (a reload) and keeps the state of the instances
that stay.

Limits an instance holds:
- at most `slots + max_queue_per_instance` of the fleet's requests (`slots` is its
  `max_num_seqs`): that is, at most `max_queue_per_instance` waiting beyond what it runs;
  a request that would exceed it goes to another instance (overflow). A batch request
  takes a running slot only: it waits in the gateway's queue, whose order puts
  interactive requests first, never in an instance's, where it would be ahead of them;
- on an instance shared by both lanes, at most `max_long_per_instance` long requests
  still in prefill, so short requests never wait behind a wall of long ones; the other
  long prompts wait in the gateway queue for the first long place free.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from .affinity import BLOCK_TOKENS, PrefixIndex
from .health import apply_probe, note_error
from .kv_index import KvIndex
from .model import (
    HealthPolicy,
    Hop,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    LoadReport,
    LocalShare,
    PeerLoad,
    Priority,
    RateKey,
    SharedView,
    Ticket,
)
from .speed import update_slow_flags

# A prompt longer than this is no model's context today: a peer's prefill work beyond it
# per request is not believed (Instances._believable).
MAX_PROMPT_TOKENS = 1 << 20
MAX_PLACEMENTS = 256  # per publish round; beyond it the oldest are not shared


class Instances:
    states: list[InstanceState]
    limits: Limits
    health_policy: HealthPolicy

    def __init__(
        self, specs: Sequence[InstanceSpec], limits: Limits, health_policy: HealthPolicy
    ) -> None:
        self._by_name: dict[str, InstanceState] = {}
        # Prompts placed where they were not (all) cached yet, for the other processes'
        # prefix indexes; the newest `MAX_PLACEMENTS` only, taken each publish round.
        self._placements: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=MAX_PLACEMENTS)
        # Prompts of ours whose first token came where they were not known computed yet:
        # the other processes settle them too (a long prompt with them skips the long cap).
        self._settled: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=MAX_PLACEMENTS)
        self.apply(specs, limits, health_policy)

    def apply(
        self,
        specs: Sequence[InstanceSpec],
        limits: Limits,
        health_policy: HealthPolicy,
        departed: Mapping[str, InstanceState] | None = None,
    ) -> None:
        """Instances by name: one already here keeps its state with its new spec.

        `departed` are removed instances that still hold requests: one added back gets
        its state back, so its in-flight count stays exact.
        """
        # No instance at all is a fleet too (discovery found none yet): every request is
        # refused, 503, until one comes.
        states = []
        for spec in specs:
            state = self._by_name.get(spec.name) or (departed or {}).get(spec.name)
            if state is None:
                state = InstanceState(spec)
                state.cache = PrefixIndex(limits.prefix_index_blocks)
            state.spec = spec
            if not spec.kv_events:
                state.kv = None
            elif state.kv is None:
                state.kv = KvIndex()
            states.append(state)
        self.states = states
        self._kv_heard = any(s.kv is not None for s in states)  # else kv_blocks is None
        self.limits = limits
        self.health_policy = health_policy
        self._by_name = {s.name: s for s in states}
        # Each hop goes to the instances whose role takes it; of those, where a lane has
        # no dedicated or shared instance, it may use any.
        self.has_prefill_role = any(s.spec.role == "prefill" for s in states)
        self._eligible: dict[tuple[Lane, Hop], list[InstanceState]] = {}
        for hop in Hop:
            takers = [s for s in states if s.takes(hop)]
            for lane in Lane:
                self._eligible[lane, hop] = [s for s in takers if s.serves(lane)] or takers

    def state(self, name: str) -> InstanceState:
        return self._by_name[name]

    def has(self, name: str) -> bool:
        """Whether `name` is in the fleet (a reload may have removed it since)."""
        return name in self._by_name

    def model_served(self, model: str) -> bool:
        """Whether any instance, up or down, may serve `model` (unknown lists count as yes)."""
        return any(s.serves_model(model) for s in self.states)

    def knows_model(self, model: str) -> bool:
        """Whether some instance is known to serve `model` (bounds the metrics' model label)."""
        return any(s.models is not None and model in s.models for s in self.states)

    def served_models(self) -> list[str]:
        """Every model some instance is known to serve, sorted."""
        return sorted({m for s in self.states for m in s.models or ()})

    def least_busy_available(self, now: float, model: str | None = None) -> str | None:
        """The available instance (of `model`'s, if named) with the fewest of our requests,
        the first listed on a tie (None: none is up)."""
        up = [s for s in self.states if s.available(now) and s.serves_model(model)]
        return min(up, key=lambda s: s.inflight).name if up else None

    def alive(self, lane: Lane, model: str | None, now: float, hop: Hop = Hop.WHOLE) -> bool:
        """Whether an instance that may take `hop` of a `lane` request for `model` is up."""
        return any(s.available(now) and s.serves_model(model) for s in self._eligible[lane, hop])

    def eligible(self, lane: Lane, hop: Hop) -> Sequence[InstanceState]:
        """The instances that may take `hop` of a `lane` request, up or not."""
        return self._eligible[lane, hop]

    # ------------------------------------------------------------ room and observations

    def untried_available(
        self,
        lane: Lane,
        tried: frozenset[str],
        now: float,
        model: str | None = None,
        hop: Hop = Hop.WHOLE,
    ) -> bool:
        """Whether a retry of a `lane` request that tried `tried` has anywhere left to go."""
        return any(
            s.available(now) and s.name not in tried and s.serves_model(model)
            for s in self._eligible[lane, hop]
        )

    def set_drained(self, drained: Mapping[str, float]) -> bool:
        """The instances taken out of rotation (name: since when), every other back in;
        whether any went out or came back."""
        changed = False
        for state in self.states:
            since = drained.get(state.name)
            if (since is None) != (state.drained_since is None):
                changed = True
            state.drained_since = since
        return changed

    def observe_tpot(self, name: str, seconds: float) -> None:
        """A streamed answer's time per output token on `name` (if still in the fleet)."""
        if name in self._by_name:
            self._by_name[name].speed.observe_tpot(seconds)

    def update_slow_flags(self) -> dict[str, bool]:
        """Re-evaluate which instances are slow cards; return the flags that changed."""
        return update_slow_flags({s.name: s.speed for s in self.states})

    def take_placements(self) -> list[tuple[str, tuple[int, ...]]]:
        """The prompts placed since the last call (instance, block hashes), to publish."""
        out = list(self._placements)
        self._placements.clear()
        return out

    def take_settled(self) -> list[tuple[str, tuple[int, ...]]]:
        """The prompts computed for us since the last call (instance, block hashes)."""
        out = list(self._settled)
        self._settled.clear()
        return out

    def learn_settled(self, settled: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Another process's request had its first token with these blocks there."""
        for name, blocks in settled:
            state = self._by_name.get(name)
            if state is not None:
                state.cache.settle(blocks)

    def names(self) -> frozenset[str]:
        """The instances of the fleet now."""
        return frozenset(self._by_name)

    def kv_index(self, name: str) -> KvIndex | None:
        """The KV events index of instance `name` (None: it has none, or is gone)."""
        state = self._by_name.get(name)
        return None if state is None else state.kv

    def kv_blocks(self, model: str | None) -> tuple[int, str | None] | None:
        """How to chain a prompt for `model` so the KV events indexes can look it up: their
        block size, and the LoRA adapter's name if `model` is one they have seen. None if no
        instance that may serve it has a usable index (the prompt need not be tokenized)."""
        if not self._kv_heard:
            return None
        for state in self.states:
            kv = state.kv
            if kv is not None and kv.usable and kv.block_size and state.serves_model(model):
                return kv.block_size, model if model in kv.adapters else None
        return None

    def learn_placements(self, placements: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Another process placed these prompts: they are (about to be) cached there too,
        so every process agrees where a prefix lives."""
        for name, blocks in placements:
            state = self._by_name.get(name)
            if state is not None:
                state.cache.insert(blocks)

    def hear_peers(self, view: SharedView, now: float) -> None:
        """The other processes' load counts toward every instance's limit and score; their
        speeds blend with ours, so every process judges a slow card alike."""
        for state in self.states:
            state.peers = self._believable(state, view.loads.get(state.name, PeerLoad()), now)
            state.speed.blend(view.speeds.get(state.name, ()))

    def room(self, name: str) -> int:
        """Requests `name` may hold, fleet-wide: its running slots and its queue."""
        return self.state(name).slots + self.limits.max_queue_per_instance

    def note_full(self, name: str) -> None:
        """The shared store refused one of our requests a place on `name`: count it full,
        that request's place included (it is handed back next), until the next view says
        otherwise (the others' places there are taken, whoever took them)."""
        state = self.state(name)
        taken = max(state.peers.inflight, self.room(name) - state.inflight + 1)
        state.peers = dataclasses.replace(state.peers, inflight=taken)

    def _believable(self, state: InstanceState, claim: PeerLoad, now: float) -> PeerLoad:
        """As much of the peers' claim as the instance can hold and its own metrics allow.

        A claim makes this process more careful at most up to the instance's limit (its
        running slots and queue), and, while its metrics are fresh, at most one batch of
        running slots beyond the requests it reported that are not ours: a peer that says
        (or a bad entry in Redis that says) a card is full which the card itself says is
        idle cannot make us refuse what the card can take. A batch of slack, because a
        scrape is seconds old and honest peers place requests in between.
        """
        room = state.slots + self.limits.max_queue_per_instance
        report = state.fresh_report(now, self.limits.metrics_stale_after)
        if report is not None:  # what it holds that is not ours: the peers' and others'
            seen = max(0, report.running + report.waiting - state.own_at_report)
            room = min(room, math.ceil(seen) + state.slots)
        # Prefill work: at most a context's worth per request it may hold.
        tokens = room * MAX_PROMPT_TOKENS
        if (
            claim.inflight <= room
            and claim.long_prefilling <= room
            and claim.pending_prefill_tokens <= tokens
        ):
            return claim
        return PeerLoad(
            min(claim.inflight, room),
            min(claim.pending_prefill_tokens, tokens),
            min(claim.long_prefilling, room),
            min(claim.long_running, room),
        )

    def observe_error(self, name: str, error: str, now: float) -> None:
        """A failure that is no verdict (a scrape's): kept among the instance's recent ones."""
        state = self._by_name.get(name)
        if state is not None:
            note_error(state, error, now)

    def observe_probe(
        self, name: str, ok: bool, now: float, error: str | None = None
    ) -> bool | None:
        """An active health probe answered (or failed, `error` says why): whether `name`'s
        up/down verdict changed; None for an instance no longer in the fleet."""
        state = self._by_name.get(name)
        if state is None:
            return None
        if error is not None:
            note_error(state, error, now)
        was_up = state.up
        changed = apply_probe(state, ok, self.health_policy, now)
        if changed and state.up and was_up is False:
            state.cache.clear()  # it came back: most likely restarted, with a cold cache
        return changed

    def observe_models(self, name: str, models: frozenset[str]) -> bool:
        """The models `name` lists now (its /v1/models); whether that is news."""
        state = self._by_name.get(name)
        if state is None or state.observed_models == models:
            return False
        if state.observed_models is not None:
            state.cache.clear()  # another model now: nothing it cached still applies
        state.observed_models = models
        return True

    def local_share(
        self,
        queued: Mapping[Lane, int],
        rates: Mapping[RateKey, float],
        queued_batch: Mapping[Lane, int],
        key_queued: Mapping[str, int] | None = None,
        key_service: Mapping[str, float] | None = None,
    ) -> LocalShare:
        """What this process tells the others: its own load and learned speed of each
        instance, with its `queued` requests per lane (of those, `queued_batch` batch
        ones), drain `rates`, and per key its requests queued and service given."""
        return LocalShare(
            loads={
                s.name: PeerLoad(
                    s.inflight, s.pending_prefill_tokens, s.long_prefilling, s.long_running
                )
                for s in self.states
            },
            speeds={s.name: s.speed.own() for s in self.states},
            queued=queued,
            rates=rates,
            queued_batch=queued_batch,
            key_queued=key_queued or {},
            key_service=key_service or {},
        )

    def report_load(self, name: str, report: LoadReport) -> None:
        state = self._by_name.get(name)
        if state is None:
            return
        last = state.report
        if (
            last is not None
            and last.prefix_queries is not None
            and report.prefix_queries is not None
            and report.prefix_queries < last.prefix_queries
        ):
            state.cache.clear()  # its counters went back: it restarted, with a cold cache
        if self.limits.prefix_index_learned and report.cache_tokens is not None:
            # Remember what its cache can hold, no more: a larger index would keep
            # prefixes the instance has already evicted, and send requests after them.
            state.cache.resize(-(-report.cache_tokens // BLOCK_TOKENS))
        state.learned_slots = learned_slots(state, last, report)
        state.running_seen = max(state.running_seen, report.running)
        state.report = report
        state.inflight_at_report = state.total_inflight
        state.own_at_report = state.inflight

    def candidates(self, ticket: Ticket, now: float, holding: int) -> list[InstanceState]:
        """Where `ticket` may go now: the instances eligible for it, up and with room, and
        of those one that did not just say "busy" unless none other may take it; none while
        `holding` (requests placed in all) is at the global limit."""
        limit = self.limits.global_limit
        if limit is not None and holding >= limit:
            return []
        # A retry goes only to instances it has not tried; the shell checks that one
        # exists (`untried_available`) before it retries.
        room = [
            s
            for s in self._eligible[ticket.lane, ticket.hop]
            if s.available(now)
            and s.serves_model(ticket.model)
            and s.name not in ticket.exclude
            and self._has_room(s, ticket)
        ]
        return [s for s in room if not s.busy(now)] or room

    def place_prefix(self, state: InstanceState, ticket: Ticket, cached: int, now: float) -> None:
        """`ticket`'s prompt goes to `state`: its blocks are (about to be) cached there."""
        # A decode hop reads its prompt's blocks from the prefill instance: it computes none,
        # so it owes no event (whether the engine announces blocks it read is the connector's).
        if state.kv is not None and ticket.hop is not Hop.DECODE:
            state.kv.hold(ticket.id, ticket.kv_chain, now)
        if not ticket.prefix:
            return
        if state.cache.match(ticket.prefix) < len(ticket.prefix):
            self._placements.append((state.name, ticket.prefix))  # new there: tell peers
        state.cache.insert(ticket.prefix)
        state.prefix_query_tokens += ticket.tokens
        state.prefix_hit_tokens += cached

    def settle_prefix(self, state: InstanceState, ticket: Ticket, now: float) -> None:
        """`ticket`'s prompt is computed on `state` now; if that is news, peers hear it. Its
        KV events should say so soon (kv_index.KvIndex.computed)."""
        if state.kv is not None:
            state.kv.computed(ticket.id, now)
        prefix, cache = ticket.prefix, state.cache
        if prefix and cache.capacity > 0 and cache.match(prefix, settled=True) < len(prefix):
            self._settled.append((state.name, prefix))
        cache.settle(prefix)

    def beyond_slots(self, lane: Lane, model: str | None, hop: Hop = Hop.WHOLE) -> int:
        """The fleet's requests waiting at `lane`'s instances for `model` beyond their
        running slots: they start before anything the gateway still queues."""
        return sum(
            max(0, s.total_inflight - s.slots)
            for s in self._eligible[lane, hop]
            if s.serves_model(model)
        )

    def places_left(self, state: InstanceState, ticket: Ticket) -> int:
        """Requests like `ticket` that `state` may still take, fleet-wide (its long-prefill
        cap aside)."""
        beyond_slots = (
            0 if ticket.priority is Priority.BATCH else self.limits.max_queue_per_instance
        )
        return max(0, state.slots + beyond_slots - state.total_inflight)

    def _has_room(self, state: InstanceState, ticket: Ticket) -> bool:
        if self.places_left(state, ticket) == 0:
            return False
        if self._capped_long(state) and self.takes_long_place(state, ticket):
            # Fleet-wide: the other processes' long requests there take places too.
            long_prefilling = state.long_prefilling + state.peers.long_prefilling
            return long_prefilling < self.limits.max_long_per_instance
        return True

    @staticmethod
    def _capped_long(state: InstanceState) -> bool:
        """`max_long_per_instance` keeps long prefills from stalling the short requests
        decoding on an instance both lanes share; a prefill instance decodes nothing."""
        return state.spec.lane == "any" and state.spec.role != "prefill"

    def takes_long_place(self, state: InstanceState, ticket: Ticket) -> bool:
        """A long request counts as a long prefill there, unless it is cached there enough
        that what is left to compute is short (`max_long_per_instance` binds on shared
        instances only). A decode hop prefills nothing: its blocks come from elsewhere."""
        if ticket.lane is not Lane.LONG or ticket.hop is Hop.DECODE:
            return False
        # Only blocks already computed there count: a burst of long prompts sharing one
        # document would otherwise all skip the cap while the first is still prefilling.
        cached = state.cached_tokens(ticket, settled=True)
        return cached == 0 or ticket.tokens - cached > self.limits.long_input_threshold

    def __repr__(self) -> str:
        instances = " ".join(f"{s.name}={s.verdict}/{s.inflight}" for s in self.states)
        return f"<Instances {instances or 'empty'}>"


def learned_slots(state: InstanceState, last: LoadReport | None, report: LoadReport) -> int | None:
    """What the instance showed it can run, from two scrapes in a row (None: its configured
    slots, as far as we can tell).

    Requests waiting there while its running count stays put, twice, mean it runs no more
    than that: its `--max-num-seqs` (which the operator may not have copied into our
    settings) or what its KV cache admits now. One scrape is not enough: a request that
    arrived a moment ago waits for the next engine step, and a long prefill holds the
    next ones back for a step or two, with slots free. Once it runs more, with nothing
    waiting, what it showed before no longer holds.
    """
    known = state.learned_slots
    if report.waiting >= 1 and report.running >= 1 and last is not None and last.waiting >= 1:
        if round(report.running) == round(last.running):
            seen = round(report.running)
            return seen if seen < state.spec.slots else None
        return known
    if known is not None and report.running > known:
        seen = round(report.running)
        return None if report.waiting < 1 or seen >= state.spec.slots else seen
    return known
