"""The scheduler: which instance takes a request, or whether it waits or is turned away.

Pure and synchronous, in the manner of httpcore's connection pool: every method takes
the shell's `now` (and an `rng` where a choice is made), changes the state, and returns
decisions. Decisions about requests that were waiting in the gateway queue come back as
a list from whichever call freed room (`release`, `prefill_done`, `probe`), and the
shell wakes those requests.

The scheduler has the fleet's state (`self.instances`, `instances.py`): where a request may go
(its limits, lane, models) is the fleet's to say, and what the shell observes of an
instance that places no request goes there through the few methods the dispatcher needs
(the last section below). The scheduler keeps what the fleet does not: the gateway queue,
the requests it holds on instances, and the rates and counts learned from them. With no
room, a request waits in a bounded queue of its lane (and model) for at most the lane's
`max_queue_wait`, never past its deadline; one whose predicted wait is longer is refused
at once (`admission.py`). The queue serves keys by fair share (`fairness.py`), and a
request's predicted wait is its key's: the requests of its key ahead of it, at its key's
part of the departure rate.

A request for a model goes only to instances that serve it (`InstanceState.models`);
its prompt's cached share on each (`affinity.py`), estimated here, counts in the
strategies' costs, and only the rest as prefill work.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from .admission import DepartureRates, predicted_wait, refusal
from .disaggregation import fastest_prefill, split
from .fairness import ServiceCounts
from .health import apply_outcome
from .holding import Held as _Held
from .holding import UnknownTicket
from .instances import Instances
from .kv_index import KvIndex
from .model import (
    Assigned,
    Decision,
    HealthPolicy,
    Hop,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    LoadReport,
    LocalShare,
    Outcome,
    Priority,
    Queued,
    Rejected,
    RejectReason,
    SharedView,
    Ticket,
)
from .queues import QueueKey, WaitQueues
from .snapshot import Snapshot, instances_at
from .speed import Ewma
from .strategies import Strategy
from .ticket_state import IllegalMove, TicketState, move

# Requests an instance may hold before its metrics must have shown it runs that many.
UNCONFIRMED = 8


class Scheduler:
    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        strategy: Strategy,
        limits: Limits = Limits(),
        health_policy: HealthPolicy = HealthPolicy(),
    ) -> None:
        self.instances = Instances(specs, limits, health_policy)
        self.strategy = strategy
        self.closed = False
        self._queues = WaitQueues()
        self._service = ServiceCounts(limits.shares)  # each key's fair-share count
        # Per queue: since when its head leaves places to a peer's key, and when its last
        # wait for a peer ran out (fairness across replicas, `_leaves_to_peers`).
        self._yield_since: dict[QueueKey, float] = {}
        self._yield_spent: dict[QueueKey, float] = {}
        self._shared = SharedView()  # the other gateway processes, as last heard
        self._holding: dict[int, _Held] = {}
        # Departure rates per lane and model (admission's departure rate): each model's
        # instances serve its own queue.
        self._departures = DepartureRates()
        # Each lane's time from sending a request to its first token, leaning to the slow
        # side (a slower sample weighs 0.5, a faster 0.1): what admission budgets for it.
        self._service_ttft = {lane: Ewma(higher_is_better=False) for lane in Lane}
        # A decode hop's time from sending to its first token, less one engine step there
        # (its learned time per output token), per prompt token: the KV blocks' transfer,
        # what a second hop costs. The decode instance's own step and queue are not in it
        # (a whole request pays them too), so it leans to the fast samples (a faster one
        # weighs 0.5, a slower 0.1): a busy decode instance must not make the second hop
        # look dear, or prompts are served whole there and make it busier.
        self._transfer = Ewma(higher_is_better=True)

    def apply(
        self,
        specs: Sequence[InstanceSpec],
        limits: Limits,
        health_policy: HealthPolicy,
        now: float,
        rng: random.Random,
    ) -> list[Decision]:
        """A reloaded configuration: a new instance list, limits and health policy (the
        core sees no `Config`: fleet/inputs.py makes these from it and the instance list).

        Instances that stay (by name) keep their state: health, in-flight requests,
        learned speed, prefix index. New ones start unknown until probed. Removed ones
        take no new request; those they hold finish and `release` as usual. Queued
        requests may now fit (more room) or have nowhere left to go (rejected).
        """
        departed = {h.state.name: h.state for h in self._holding.values()}
        self.instances.apply(specs, limits, health_policy, departed)
        self._service.apply(limits.shares)
        return self._place_waiting(now, rng)

    # ------------------------------------------------------------ queries

    @property
    def limits(self) -> Limits:
        """The limits it runs with now (the fleet's: a reload changes both at once)."""
        return self.instances.limits

    def _ahead(
        self,
        lane: Lane,
        model: str | None = None,
        hop: Hop = Hop.WHOLE,
        priority: Priority = Priority.INTERACTIVE,
    ) -> int:
        """Requests that start before a new `lane` request for `model` of `priority`'s
        class would: of its class, queued for the same; and waiting at its instances
        beyond their running slots. The other processes' queues count whole for a batch
        request, their interactive part for an interactive one."""
        peers_queued = self._shared.queued.get(lane, 0)
        if priority is Priority.INTERACTIVE:
            peers_queued -= self._shared.queued_batch.get(lane, 0)
        at_instances = self.instances.beyond_slots(lane, model, hop)
        own = self._queues.length_for(lane, model, hop, priority)
        return own + max(0, peers_queued) + at_instances

    def _bounded(self, lane: Lane, priority: Priority = Priority.INTERACTIVE) -> int:
        """What a new `lane` request of `priority`'s class finds against the bound
        `gateway_queue_size` (fleet-wide, with a shared view): every new request waiting
        for a batch one; the interactive ones alone for an interactive one, so batch
        requests never fill the queue that interactive ones need. The queue may then hold
        up to the bound of each class."""
        waiting = self._queues.fifo_length(lane)
        peers = self._shared.queued.get(lane, 0)
        if priority is Priority.INTERACTIVE:
            waiting -= self._queues.batch_length(lane)
            peers -= self._shared.queued_batch.get(lane, 0)
        return waiting + max(0, peers)

    def _predicted_wait(
        self,
        lane: Lane,
        now: float,
        model: str | None = None,
        hop: Hop = Hop.WHOLE,
        priority: Priority = Priority.INTERACTIVE,
    ) -> float | None:
        """How long a new `lane` request of `priority`'s class would wait to start (None:
        its class's rate not known yet)."""
        ahead = self._ahead(lane, model, hop, priority)
        return predicted_wait(ahead, self._departures.rate(lane, model, now, priority))

    def splits(self, ticket: Ticket, now: float) -> bool:
        """Whether `ticket` goes in two hops: prefill on a prefill instance, then decode
        (disaggregation.py). Never in a fleet without prefill instances."""
        return split(
            self.instances.eligible(ticket.lane, Hop.PREFILL),
            self.instances.eligible(ticket.lane, Hop.DECODE),
            ticket,
            now,
            transfer_s_per_token=self._transfer.value,
            stale_after=self.limits.metrics_stale_after,
        )

    # ------------------------------------------------------------ requests

    def submit(self, ticket: Ticket, now: float, rng: random.Random) -> Decision:
        """A new request (or a retry): assign it, queue it, or reject it."""
        if (was := self._ticket_state(ticket.id)) is not TicketState.NEW:
            # The moves below are out of new: a queued one would pass as refused from the queue.
            raise IllegalMove(f"ticket {ticket.id} is {was.value}: only a new one is submitted")
        if self.closed:
            return self._refuse(ticket, "shutting_down", self.limits.queue_retry_after)
        if ticket.deadline <= now:
            return self._refuse(ticket, "deadline", self.limits.queue_retry_after)
        if not self.instances.alive(ticket.lane, ticket.model, now, ticket.hop):
            return self._refuse(ticket, "no_instance", self.limits.queue_retry_after)
        if ticket.exclude:
            return self._submit_retry(ticket, now, rng)
        lane, model, hop, priority = ticket.lane, ticket.model, ticket.hop, ticket.priority
        wait_until = min(ticket.deadline, now + self.limits.max_queue_wait(lane, priority))
        # In the queue's order: nobody may overtake requests already waiting for the same
        # lane, model and hop whose wait runs out first (of its class, all of them).
        if not self._queues.waiting_before(ticket, wait_until):
            candidates = self.instances.candidates(ticket, now, len(self._holding))
            if candidates:
                return self._assign(ticket, candidates, now, rng)
        if self._bounded(lane, priority) >= self.limits.gateway_queue_size:
            wait = self._predicted_wait(lane, now, model, hop, priority)
            return self._refuse(ticket, "queue_full", wait or self.limits.queue_retry_after)
        rate = self._departures.rate(lane, model, now, priority)
        # It must also have its first token in time once it starts: the lane's usual time
        # from being sent to its first token comes off the budget.
        budget = wait_until - now - (self._service_ttft[ticket.lane].value or 0.0)
        refused = refusal(self._ahead_of_key(ticket), rate, budget)
        if refused is not None:
            return self._refuse(ticket, "predicted_wait", refused)
        self._move(ticket.id, TicketState.QUEUED)
        # It starts waiting: in no process's queue now (a key waiting at a replica is
        # backlogged, however often its queue here empties: no lift to erase its due).
        peers = {key for key, n in self._shared.key_queued.items() if n}
        if ticket.key not in self._queues.waiting_keys() and ticket.key not in peers:
            self._service.arrive(ticket.key, {*self._queues.waiting_keys(), *peers})
        return Queued(ticket, self._queues.add(ticket, wait_until), wait_until)

    def _ahead_of_key(self, ticket: Ticket) -> float:
        """The requests that start before `ticket` under fair share: those waiting at its
        instances and the retries, then its key's queue and the turns the other waiting
        keys get meanwhile, by their counts (fairness.py). Its class's queue in every
        process counts, the others' per key (as they last said)."""
        lane, model, hop, priority = ticket.lane, ticket.model, ticket.hop, ticket.priority
        waiting = {
            key: self._queues.key_length_for(key, lane, model, hop, priority)
            for key in self._queues.keys_for(lane, model, hop, priority)
        }
        retries = self._queues.length_for(lane, model, hop, priority) - sum(waiting.values())
        for key, n in self._shared.key_queued.items():
            waiting[key] = waiting.get(key, 0) + n
        places = self._service.places_before(ticket.key, waiting)
        # Its own place is the last of `places`; refusal counts that one itself.
        return self.instances.beyond_slots(lane, model, hop) + retries + places - 1

    def _submit_retry(self, ticket: Ticket, now: float, rng: random.Random) -> Decision:
        """A retry goes to an untried instance with room, or waits apart for one."""
        if not self._untried_alive(ticket, now):
            return self._refuse(ticket, "no_instance", self.limits.queue_retry_after)
        candidates = self.instances.candidates(ticket, now, len(self._holding))
        if candidates:
            return self._assign(ticket, candidates, now, rng)
        if self._queues.retry_count() >= self.limits.gateway_queue_size:
            return self._refuse(ticket, "queue_full", self.limits.queue_retry_after)
        # A retry was admitted once already; it waits apart, bounded like any other.
        wait = self.limits.max_queue_wait(ticket.lane, ticket.priority)
        wait_until = min(ticket.deadline, now + wait)
        self._move(ticket.id, TicketState.QUEUED)
        return Queued(ticket, self._queues.add(ticket, wait_until), wait_until)

    def cancel(self, ticket_id: int) -> bool:
        """Drop a queued request whose client left; False if it is not queued (any more)."""
        if ticket_id not in self._queues:
            return False
        self._move(ticket_id, TicketState.CANCELLED)
        return True

    def expire(self, ticket_id: int, now: float, rng: random.Random) -> list[Decision]:
        """A queued request's wait ran out: refused (503, it never reached an instance).
        Nothing if it is no longer queued or its time has not come (the shell's timer may
        run early; it asks again)."""
        wait_until = self._queues.wait_until(ticket_id)
        if wait_until is None or wait_until > now:
            return []
        ticket = self._queues.get(ticket_id)
        assert ticket is not None
        # Room may have come back unannounced (an ejection that ran out): it starts there.
        if ticket.deadline > now and (
            candidates := self.instances.candidates(ticket, now, len(self._holding))
        ):
            return [self._assign(ticket, candidates, now, rng)]
        return [self._refuse(ticket, "deadline", self.limits.queue_retry_after)]

    def wait_until(self, ticket_id: int) -> float | None:
        return self._queues.wait_until(ticket_id)

    def prefill_done(
        self, ticket_id: int, now: float, rng: random.Random, ttft: float | None = None
    ) -> list[Decision]:
        """The first token arrived `ttft` s after the request was sent to its instance.

        Its prompt leaves the instance's prefill work; the time teaches the prefill rate
        (on the tokens computed: a cache hit is not a fast card); a long one gives up its
        long-prefill place. A decode hop computed no prompt: its time teaches what moving
        a prompt's KV blocks costs instead.
        """
        held = self._holding.get(ticket_id)
        if held is None or not held.prefilling:
            return []
        held.end_prefill()
        if held.departs_at_prefill:
            self._depart(held, now)
        self.instances.settle_prefix(held.state, held.ticket, now)
        if ttft is not None and held.ticket.hop is Hop.DECODE:
            if held.ticket.tokens:
                # Never below zero: a hop quicker than a step moved its blocks for free.
                moved = max(ttft - (held.state.speed.tpot_value or 0.0), 1e-9)
                self._transfer.update(moved / held.ticket.tokens)
        elif ttft is not None:
            held.state.speed.observe_prefill(held.ahead + held.uncached, ttft)
            self._service_ttft[held.ticket.lane].update(ttft)
        return self._place_waiting(now, rng) if held.long_place else []

    def release(
        self,
        ticket_id: int,
        outcome: Outcome,
        now: float,
        rng: random.Random,
        error: str | None = None,
    ) -> list[Decision]:
        """A request left its instance (done, failed or cancelled); hand its place on."""
        try:
            held = self._holding.pop(ticket_id)
        except KeyError:
            raise UnknownTicket(ticket_id) from None
        prefilling = held.prefilling
        held.leave()
        if outcome is Outcome.SUCCESS:  # a whole answer: its prompt was computed there
            self.instances.settle_prefix(held.state, held.ticket, now)
        if held.state.kv is not None:  # what it did not compute, nobody will
            held.state.kv.release(ticket_id)
        if prefilling or not held.departs_at_prefill:  # else it departed at its first token
            self._depart(held, now)
        instances = self.instances
        apply_outcome(held.state, outcome, now, instances.health_policy, instances.states, error)
        return self._place_waiting(now, rng)

    def _depart(self, held: _Held, now: float) -> None:
        """`held` frees the place that held the next request of its lane back: a departure,
        saturated if requests of its lane and model were waiting for it. A prefill hop is
        not one: its request departs when its decode hop does."""
        ticket = held.ticket
        if ticket.hop is Hop.PREFILL:
            return
        lane, model, priority = ticket.lane, ticket.model, ticket.priority
        saturated = self._queues.length_for(lane, model, ticket.hop, priority) > 0
        self._departures.record(lane, model, now, saturated, priority)

    def charge_output(self, key: str, output_tokens: int) -> None:
        """`key`'s answer ended with `output_tokens`: its fair-share count (its prompt was
        counted when it was placed)."""
        self._service.charge(key, output_tokens=output_tokens)

    # ------------------------------------------------------------ instances

    def probe(
        self, name: str, ok: bool, now: float, rng: random.Random, error: str | None = None
    ) -> list[Decision]:
        """An active health probe answered (or failed, and why); ignored for a removed
        instance."""
        changed = self.instances.observe_probe(name, ok, now, error)
        if changed is None:
            return []
        # Also place what waits when nothing changed: an ejection may have run out since.
        return self._place_waiting(now, rng) if changed or self._queues else []

    def set_models(
        self, name: str, models: frozenset[str], now: float, rng: random.Random
    ) -> list[Decision]:
        """The models `name` lists now (its /v1/models); requests waiting for them may go."""
        return self._place_waiting(now, rng) if self.instances.observe_models(name, models) else []

    def set_drained(
        self, drained: Mapping[str, float], now: float, rng: random.Random
    ) -> list[Decision]:
        """The instances taken out of rotation (name: since when), every other back in.

        A drained instance takes no new request; those it holds finish. Queued requests
        go elsewhere, or are refused if nowhere is left; one resumed may take them.
        """
        return self._place_waiting(now, rng) if self.instances.set_drained(drained) else []

    def apply_shared(
        self, view: SharedView, now: float, rng: random.Random, *, place: bool = True
    ) -> list[Decision]:
        """What the other gateway processes hold now (load, queues, learned speeds).

        Their load counts toward every limit and score; their speeds blend with ours, so
        every process judges a slow card alike. An empty view is the local view alone.
        With `place` False, queued requests wait for the shell's `place_waiting` call.
        """
        # Each peer's queue is bounded as ours is: more than that is not believed.
        bound = self.limits.gateway_queue_size * max(1, view.peers)
        if any(n > bound for n in (*view.queued.values(), *view.queued_batch.values())):
            queued = {lane: min(n, bound) for lane, n in view.queued.items()}
            batch = {lane: min(n, bound) for lane, n in view.queued_batch.items()}
            view = dataclasses.replace(view, queued=queued, queued_batch=batch)
        self._shared = view
        self._departures.peers = view.rates
        self._service.peers = view.key_service
        self.instances.hear_peers(view, now)
        # Peers may have let go of places: waiting requests may fit now.
        return self._place_waiting(now, rng) if place and self._queues else []

    def overbooked(self, name: str) -> list[int]:
        """Our requests on `name` still without a first token, newest first, beyond what it
        showed it can hold (its learned slots and its queue): to be taken back.

        An instance that runs fewer requests than we thought queues the rest, and they
        wait there past their deadlines (a 504 each). Taken back before a token was sent,
        a request may still go elsewhere or be refused at once with Retry-After. The
        newest go first: the instance serves its queue in order, so they wait longest.
        """
        state = self.instances.state(name)
        if state.learned_slots is None:
            return []
        excess = state.total_inflight - (state.slots + self.limits.max_queue_per_instance)
        if excess <= 0 or not state.inflight:
            return []
        # Our share of it: every gateway process takes back its own part, not the whole.
        excess = -(-excess * state.inflight // state.total_inflight)
        waiting = [
            ticket
            for ticket, held in reversed(self._holding.items())
            if held.state is state and held.prefilling
        ]
        return waiting[:excess]

    def unconfirmed(self, name: str) -> bool:
        """Whether we hold more on `name` than it ever showed running (and at least
        UNCONFIRMED): time to look at its metrics again, rather than at the next round,
        in case it runs fewer than its configured slots."""
        state = self.instances.state(name)
        return state.learned_slots is None and state.total_inflight > max(
            UNCONFIRMED, 2 * state.running_seen
        )

    def place_waiting(self, now: float, rng: random.Random) -> list[Decision]:
        """Place (or turn away) the queued requests that can be now."""
        return self._place_waiting(now, rng) if self._queues else []

    @property
    def queued(self) -> bool:
        """Whether any request waits in the gateway queue."""
        return bool(self._queues)

    def share(self, now: float) -> LocalShare:
        """What this process tells the others: its own load, queues and learned speeds."""
        queued = {lane: self._queues.length(lane) for lane in Lane}
        batch = {lane: n for lane in Lane if (n := self._queues.batch_length(lane))}
        keys = self._queues.key_counts()
        rates, service = self._departures.own(now), self._service.own()
        return self.instances.local_share(queued, rates, batch, keys, service)

    def close(self) -> list[Decision]:
        """Shutting down: refuse new requests and turn away every queued one."""
        self.closed = True
        after = self.limits.queue_retry_after
        return [self._refuse(t, "shutting_down", after) for t in list(self._queues)]

    # ------------------------------------------------------------ internals

    def _ticket_state(self, ticket_id: int) -> TicketState:
        """Where the scheduler keeps `ticket_id`: in the queue, held (prefilling or decoding),
        or nowhere (new, or gone: a ticket that ended is forgotten)."""
        held = self._holding.get(ticket_id)
        if held is not None:
            return held.ticket_state
        return TicketState.QUEUED if ticket_id in self._queues else TicketState.NEW

    def _move(self, ticket_id: int, to: TicketState) -> None:
        """`ticket_id` goes on to `to`, if the state table allows (ticket_state.py); one that
        leaves the queue is taken out of it here. A held one moves in `Held`."""
        was = self._ticket_state(ticket_id)
        move(ticket_id, was, to)
        if was is TicketState.QUEUED:
            self._queues.remove(ticket_id)

    def _refuse(self, ticket: Ticket, reason: RejectReason, retry_after: float) -> Rejected:
        """`ticket` is turned away (from the queue, if it waited there)."""
        self._move(ticket.id, TicketState.REJECTED)
        return Rejected(ticket, reason, retry_after)

    def _untried_alive(self, ticket: Ticket, now: float) -> bool:
        instances = self.instances
        return instances.untried_available(
            ticket.lane, ticket.exclude, now, ticket.model, ticket.hop
        )

    def _assign(
        self, ticket: Ticket, candidates: Sequence[InstanceState], now: float, rng: random.Random
    ) -> Assigned:
        self._move(ticket.id, TicketState.PREFILLING)
        if ticket.hop is Hop.PREFILL:
            state = fastest_prefill(candidates, ticket, rng)
        else:
            state = self.strategy.choose(candidates, self.instances.states, ticket, now, rng)
        cached = state.cached_tokens(ticket)
        if ticket.hop is not Hop.DECODE:  # a decode hop's prompt was its prefill hop's
            self._service.charge(ticket.key, prompt_tokens=ticket.tokens)
        held = _Held(
            state,
            ticket,
            # The peers' prefill there is ahead too (else replicas learn too slow a rate).
            ahead=state.pending_prefill_tokens + state.peers.pending_prefill_tokens,
            # A decode hop reads its prompt's KV blocks: nothing of it to compute there.
            uncached=0 if ticket.hop is Hop.DECODE else ticket.tokens - cached,
            long_place=self.instances.takes_long_place(state, ticket),
        )
        self._holding[ticket.id] = held
        held.take()
        self.instances.place_prefix(state, ticket, cached, now)
        return Assigned(ticket, state.name)

    def _place_waiting(self, now: float, rng: random.Random) -> list[Decision]:
        """Place queued requests while any FIFO's head fits somewhere, the head whose wait
        runs out first first."""
        out: list[Decision] = []
        after = self.limits.queue_retry_after
        for (lane, model, hop, _), tickets in self._queues.fifos():
            if not self.instances.alive(lane, model, now, hop):
                for ticket in tickets:
                    out.append(self._refuse(ticket, "no_instance", after))
        for ticket in self._queues.retries():
            if not self._untried_alive(ticket, now):
                out.append(self._refuse(ticket, "no_instance", after))
        while True:
            # Retries first (they waited longest, counting their failed attempt), each on
            # its own: one that cannot be placed does not hold up the others.
            placed = False
            for ticket in self._queues.heads(self._service.count):
                wait_until = self._queues.wait_until(ticket.id)
                expired = wait_until is not None and wait_until <= now
                # One whose wait ran out, not its deadline, still starts if it can.
                candidates = (
                    []
                    if ticket.deadline <= now
                    else self.instances.candidates(ticket, now, len(self._holding))
                )
                if expired and not candidates:
                    out.append(self._refuse(ticket, "deadline", after))
                    placed = True
                    break
                if candidates and not expired and self._leaves_to_peers(ticket, candidates, now):
                    continue
                if candidates:
                    out.append(self._assign(ticket, candidates, now, rng))
                    self._service.picked(ticket.key)
                    placed = True
                    break
            if not placed:
                return out

    def _leaves_to_peers(self, ticket: Ticket, candidates: list[InstanceState], now: float) -> bool:
        """Whether to leave `ticket` waiting and its places free for the other processes'
        lower-count keys (fairness.py, `owed_to_peers`): while they wait for at least as
        many places as `ticket` has, for `peer_yield` at most, and never into the last
        `peer_yield` of its own wait; then every place free is filled (the fleet never
        idles longer on a peer that does not come), and the next place freed waits anew.
        The wait is kept per queue, so one queue's placements do not prolong another's.
        A decode hop is not held: its prompt is prefilled, and a peer's new request needs
        a whole or prefill place first."""
        limit = self.limits.peer_yield
        if not limit or ticket.exclude or ticket.hop is Hop.DECODE:
            return False
        queue = (ticket.lane, ticket.model, ticket.hop, ticket.priority)
        wait_until = self._queues.wait_until(ticket.id)
        if self._yield_spent.get(queue) == now or (
            wait_until is not None and wait_until - now <= limit
        ):
            return False
        owed = self._service.owed_to_peers(ticket.key, self._shared.key_queued)
        free = sum(self.instances.places_left(s, ticket) for s in candidates)
        if owed < free:
            self._yield_since.pop(queue, None)
            return False
        since = self._yield_since.setdefault(queue, now)
        if now - since < limit:
            return True
        del self._yield_since[queue]
        self._yield_spent[queue] = now
        return False

    def yield_ends(self, now: float) -> float | None:
        """When the earliest wait for a peer (`_leaves_to_peers`) runs out, if one is on:
        the shell places what waits then, rather than at the next event. A wait that has
        run out by `now` is forgotten (a placing at or after its end settled it, or its
        queue emptied)."""
        limit = self.limits.peer_yield
        for queue, since in list(self._yield_since.items()):
            if since + limit <= now:
                del self._yield_since[queue]
        return min(self._yield_since.values()) + limit if self._yield_since else None

    def snapshot(self, now: float) -> Snapshot:
        """A frozen copy of the state, for readers (metrics, health, /admin, readiness)."""
        return Snapshot(
            at=now,
            strategy=self.strategy.name,
            inflight=len(self._holding),
            queues=MappingProxyType({lane: self._queues.length(lane) for lane in Lane}),
            instances=instances_at(self.instances.states, now, self.limits.metrics_stale_after),
            key_service=MappingProxyType(self._service.own()),
            key_queued=MappingProxyType(self._queues.key_counts()),
            model_queued=MappingProxyType(Counter(t.model for t in self._queues if t.model)),
        )

    # ------------------------------------------------------------ the fleet, for the dispatcher
    # What the dispatcher asks of the instances, or tells of them, that places no request:
    # passed to the fleet (instances.py says what each does). Nothing else of it shows here.

    @property
    def has_prefill_role(self) -> bool:
        return self.instances.has_prefill_role

    def state(self, name: str) -> InstanceState:
        return self.instances.state(name)

    def has(self, name: str) -> bool:
        return self.instances.has(name)

    def names(self) -> frozenset[str]:
        return self.instances.names()

    def room(self, name: str) -> int:
        return self.instances.room(name)

    def note_full(self, name: str) -> None:
        self.instances.note_full(name)

    def knows_model(self, model: str) -> bool:
        return self.instances.knows_model(model)

    def model_served(self, model: str) -> bool:
        return self.instances.model_served(model)

    def served_models(self) -> list[str]:
        return self.instances.served_models()

    def untried_available(
        self,
        lane: Lane,
        tried: frozenset[str],
        now: float,
        model: str | None = None,
        hop: Hop = Hop.WHOLE,
    ) -> bool:
        return self.instances.untried_available(lane, tried, now, model, hop)

    def least_busy_available(self, now: float, model: str | None = None) -> str | None:
        return self.instances.least_busy_available(now, model)

    def report_load(self, name: str, report: LoadReport) -> None:
        self.instances.report_load(name, report)

    def observe_error(self, name: str, error: str, now: float) -> None:
        self.instances.observe_error(name, error, now)

    def observe_tpot(self, name: str, seconds: float) -> None:
        self.instances.observe_tpot(name, seconds)

    def update_slow_flags(self) -> dict[str, bool]:
        return self.instances.update_slow_flags()

    def kv_index(self, name: str) -> KvIndex | None:
        return self.instances.kv_index(name)

    def kv_blocks(self, model: str | None) -> tuple[int, str | None] | None:
        return self.instances.kv_blocks(model)

    def take_placements(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.instances.take_placements()

    def take_settled(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.instances.take_settled()

    def learn_placements(self, placements: Iterable[tuple[str, Sequence[int]]]) -> None:
        self.instances.learn_placements(placements)

    def learn_settled(self, settled: Iterable[tuple[str, Sequence[int]]]) -> None:
        self.instances.learn_settled(settled)

    def __repr__(self) -> str:
        return f"<Scheduler {self.strategy.name} inflight={len(self._holding)} {self._queues!r}>"
