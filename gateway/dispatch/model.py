"""The values the dispatch core reads and returns. No I/O, no clock, no randomness.

`InstanceState` is the one mutable record per instance; only the `Scheduler` changes it.
Everything the core hands back to the shell is a small frozen value.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .affinity import BLOCK_TOKENS, DEFAULT_INDEX_BLOCKS, PrefixIndex
from .kv_index import KvIndex, KvState
from .speed import PeerSpeed, Speed

InstanceLane = Literal["short", "long", "any"]
# What an instance does in a disaggregated fleet (vLLM's KV connector moves a prompt's
# KV blocks from the prefill instance to the decode one): "both" is every instance of
# a fleet that does not disaggregate.
Role = Literal["prefill", "decode", "both"]


class Lane(enum.StrEnum):
    SHORT = "short"
    LONG = "long"


class Hop(enum.StrEnum):
    """Which part of a request a ticket places (disaggregation.py decides the split).

    WHOLE: prefill and decode on one instance, as every request of a fleet without
    roles. PREFILL: the prompt alone, whose KV blocks stay held for a decode instance.
    DECODE: the answer, on an instance that reads those blocks instead of prefilling.
    """

    WHOLE = "whole"
    PREFILL = "prefill"
    DECODE = "decode"


class Priority(enum.StrEnum):
    """A request's class, from its key: batch waits behind interactive, but only until
    its own, longer, wait limit comes near (the queue serves the earliest limit first)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


# Admission measures a departure rate per lane, model and class (admission.py).
RateKey = tuple[Lane, str | None, Priority]


class Outcome(enum.Enum):
    """How an attempt on an instance ended, as far as that instance's health goes."""

    SUCCESS = "success"
    FAILURE = "failure"  # connection error, timeout or 5xx: counts toward ejection
    BUSY = "busy"  # 429 or vLLM's 503 "engine busy": alive, but prefer others for a while
    NEUTRAL = "neutral"  # 4xx, client gone, deadline: says nothing about the instance


@dataclass(frozen=True)
class InstanceSpec:
    """What the core needs to know about an instance, fixed at start-up."""

    name: str
    lane: InstanceLane = "any"
    weight: float = 1.0
    slots: int = 256
    # Models pinned in the settings; None: learned from the instance's /v1/models.
    models: frozenset[str] | None = None
    role: Role = "both"
    # It publishes its KV cache events (vLLM's --kv-events-config) and the gateway listens:
    # its prefix cache is read from them (kv_index.py) rather than inferred.
    kv_events: bool = False


@dataclass(frozen=True)
class LoadReport:
    """One scrape of an instance's `/metrics`, taken at `at` (seconds on the shell's clock)."""

    running: float
    waiting: float
    kv_usage: float | None
    at: float
    # vLLM's own prefix-cache counters (tokens), where the instance exports them.
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    # Tokens its KV cache holds, from vllm:cache_config_info (0: prefix caching off).
    cache_tokens: int | None = None


@dataclass(frozen=True)
class PeerLoad:
    """What the other gateway processes (workers, replicas) hold on one instance, as the
    shared view last said: requests in flight there, their uncached prompt tokens still in
    prefill there, how many of those hold a long-prefill place (max_long_per_instance), and
    how many long requests placed there are not fully answered yet."""

    inflight: int = 0
    pending_prefill_tokens: int = 0
    long_prefilling: int = 0
    long_running: int = 0


@dataclass(frozen=True)
class SharedView:
    """Everything the other gateway processes said, summed over them (shared.py builds it)."""

    loads: Mapping[str, PeerLoad] = field(default_factory=dict)
    speeds: Mapping[str, Sequence[PeerSpeed]] = field(default_factory=dict)
    queued: Mapping[Lane, int] = field(default_factory=dict)  # their gateway queues
    peers: int = 0  # how many other processes contributed
    # Their saturated departure rates (departures/s) per lane, model and class, summed
    # (admission.py).
    rates: Mapping[RateKey, float] = field(default_factory=dict)
    # Of `queued`, the batch requests (an interactive one waits only behind the rest).
    queued_batch: Mapping[Lane, int] = field(default_factory=dict)
    # Their new requests waiting per key, and the weighted service each key had from them
    # (fairness.py): every process orders its queue by the fleet's service counts.
    key_queued: Mapping[str, int] = field(default_factory=dict)
    key_service: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalShare:
    """What this process publishes for the others (per instance, and its queues)."""

    loads: Mapping[str, PeerLoad]
    speeds: Mapping[str, PeerSpeed]
    queued: Mapping[Lane, int]
    # Our saturated departure rate per lane, model and class, where known: with several
    # processes each drains a share of the fleet's, and admission predicts with the sum.
    rates: Mapping[RateKey, float] = field(default_factory=dict)
    queued_batch: Mapping[Lane, int] = field(default_factory=dict)
    key_queued: Mapping[str, int] = field(default_factory=dict)
    key_service: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    max_queue_per_instance: int = 32
    max_long_per_instance: int = 2
    gateway_queue_size: int = 1024
    global_limit: int | None = None  # the upstream connection pool: beyond it, queue here
    metrics_stale_after: float = 30.0
    # The one Retry-After of every 503 the gateway makes itself (no instance, queue
    # timeout, shutting down): about when a health round could bring an instance back.
    queue_retry_after: float = 1.0
    # The longest a request may wait in the gateway queue, per lane (HAProxy's `timeout
    # queue`); the app sets each lane's TTFT objective unless configured otherwise.
    max_queue_wait_short: float = math.inf
    max_queue_wait_long: float = math.inf
    # A batch request's, per lane: [slo.batch]'s TTFT objectives, never shorter than the
    # interactive class's (config/schema.py checks).
    batch_queue_wait_short: float = math.inf
    batch_queue_wait_long: float = math.inf
    # A long request whose uncached part on an instance is at most this is cheap to
    # prefill there and takes no `max_long_per_instance` place.
    long_input_threshold: int = 4096
    prefix_index_blocks: int = DEFAULT_INDEX_BLOCKS
    # Size each index from its instance's vllm:cache_config_info once it reports it.
    prefix_index_learned: bool = True
    # Each named key's share of a saturated fleet (fairness.py); a key not named has 1.
    shares: Mapping[str, float] = field(default_factory=dict)
    # With a shared view: how long a place freed here is left for a lower-count key that
    # waits only at another process, which hears of the place a push later (0: never).
    peer_yield: float = 0.0

    def max_queue_wait(self, lane: Lane, priority: Priority = Priority.INTERACTIVE) -> float:
        short = lane is Lane.SHORT
        if priority is Priority.BATCH:
            return self.batch_queue_wait_short if short else self.batch_queue_wait_long
        return self.max_queue_wait_short if short else self.max_queue_wait_long


@dataclass(frozen=True)
class HealthPolicy:
    rise: int = 2
    fall: int = 3
    eject_after_failures: int = 5
    ejection_base: float = 10.0
    ejection_max: float = 300.0
    max_ejected_fraction: float = 0.5
    busy_penalty: float = 1.0


@dataclass(frozen=True)
class Ticket:
    """A request waiting for, or holding, a place on an instance."""

    id: int
    lane: Lane
    deadline: float
    exclude: frozenset[str] = frozenset()
    tokens: int = 0  # prompt tokens
    max_tokens: int = 0  # output tokens asked for (0: unknown)
    model: str | None = None  # None: any instance may serve it
    prefix: tuple[int, ...] = ()  # the prompt's block hashes (affinity.prompt_blocks)
    # The prompt's token ids chained in the engines' blocks of `kv_block_size` tokens
    # (kv_index.chain), where an instance's KV events index can look it up; else ().
    kv_chain: tuple[int, ...] = ()
    kv_block_size: int = 0
    hop: Hop = Hop.WHOLE
    priority: Priority = Priority.INTERACTIVE
    key: str = "default"  # the client's key by name, whose fair share it uses (fairness.py)


@dataclass(frozen=True)
class Assigned:
    ticket: Ticket
    instance: str


@dataclass(frozen=True)
class Queued:
    ticket: Ticket
    position: int
    wait_until: float  # when it leaves the queue unplaced: its deadline or max_queue_wait


# predicted_wait: refused at arrival, its predicted queue wait is over its budget;
# deadline: it waited in the queue until its time (or max_queue_wait) ran out.
RejectReason = Literal["queue_full", "predicted_wait", "no_instance", "deadline", "shutting_down"]


@dataclass(frozen=True)
class Rejected:
    ticket: Ticket
    reason: RejectReason
    retry_after: float


Decision = Assigned | Queued | Rejected


@dataclass
class InstanceState:
    """Live state of one instance: health, the gateway's own load on it, the last scrape."""

    spec: InstanceSpec
    # Health: None until the first probe answers; then the active-probe verdict.
    up: bool | None = None
    probe_streak: int = 0  # >0: consecutive good probes, <0: consecutive bad ones
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    # A busy answer (429/503) makes the instance a last resort until then.
    busy_until: float | None = None
    # Taken out of rotation by the operator (POST /admin/instances/{name}/drain), since
    # this wall-clock time: no new request, those it holds finish. None: in rotation.
    drained_since: float | None = None
    # The gateway's own traffic: exact and instant.
    inflight: int = 0
    long_prefilling: int = 0
    # Long requests of ours there holding a long place, from placing until their answer
    # ends (least_time shelters short prompts while any run).
    long_running: int = 0
    pending_prefill_tokens: int = 0  # uncached prompt tokens of ours there, no first token yet
    # The models it serves, from its /v1/models (None until known; pinned ones win).
    observed_models: frozenset[str] | None = None
    cache: PrefixIndex = field(default_factory=PrefixIndex)
    kv: KvIndex | None = None  # its cache as its KV events say (spec.kv_events), else None
    prefix_query_tokens: int = 0  # prompt tokens sent, and of those the estimated cached
    prefix_hit_tokens: int = 0
    speed: Speed = field(default_factory=Speed.new)
    # The other gateway processes' load here (zero without a shared view).
    peers: PeerLoad = field(default_factory=PeerLoad)
    # What the instance itself reported; `inflight_at_report` lets us subtract the
    # gateways' share (ours and the peers') from it.
    report: LoadReport | None = None
    inflight_at_report: int = 0
    own_at_report: int = 0  # ours alone then: what the report holds of the peers' is theirs
    # Running slots the instance showed it has, when fewer than configured: it ran this
    # many while requests waited there in two scrapes in a row (its --max-num-seqs, or
    # what its KV cache admits now). None: no sign of fewer than `spec.slots`.
    learned_slots: int | None = None
    running_seen: float = 0.0  # the most it ever reported running at once
    # Totals for the operator.
    assigned_total: int = 0
    failures_total: int = 0
    ejections_total: int = 0
    # The last few failures (health.note_error), each with the scheduler's clock then.
    recent_errors: list[tuple[float, str]] = field(default_factory=list)
    # When the up/down verdict last changed (scheduler clock; None before the first
    # probe), and the active probes that failed, in all.
    verdict_since: float | None = None
    probe_failures_total: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def slots(self) -> int:
        """Running slots to place by: the configured ones, or fewer if it showed fewer."""
        learned = self.learned_slots
        return self.spec.slots if learned is None else min(learned, self.spec.slots)

    @property
    def total_inflight(self) -> int:
        """Requests every gateway process has in flight here: ours exactly, peers' as shared."""
        return self.inflight + self.peers.inflight

    def available(self, now: float) -> bool:
        """Up by its probes, not ejected for passive failures and not drained."""
        return (
            self.up is True
            and (self.ejected_until is None or now >= self.ejected_until)
            and self.drained_since is None
        )

    def busy(self, now: float) -> bool:
        return self.busy_until is not None and now < self.busy_until

    def serves(self, lane: Lane) -> bool:
        return self.spec.lane == "any" or self.spec.lane == lane.value

    def takes(self, hop: Hop) -> bool:
        """Whether its role lets it take `hop`: a prefill instance only prefills; a decode
        instance decodes, and serves whole the prompts not worth a second hop."""
        role = self.spec.role
        return role == "both" or (hop is Hop.PREFILL) == (role == "prefill")

    @property
    def models(self) -> frozenset[str] | None:
        """The models it serves, pinned or learned; None while unknown."""
        return self.spec.models if self.spec.models is not None else self.observed_models

    def serves_model(self, model: str | None) -> bool:
        """Whether it may take a request for `model` (an unknown list does not exclude)."""
        models = self.models
        return model is None or models is None or model in models

    def cached_tokens(self, ticket: Ticket, *, settled: bool = False) -> int:
        """The prompt tokens of `ticket` in its prefix cache (or, with `settled`, only those
        surely computed there already): exact where its KV events index is whole, the
        larger of both estimates where it is partial, inferred (affinity.py) elsewhere."""
        inferred = (
            min(ticket.tokens, self.cache.match(ticket.prefix, settled=settled) * BLOCK_TOKENS)
            if ticket.prefix
            else 0
        )
        kv = self.kv
        if (
            kv is None
            or not ticket.kv_chain
            or not kv.usable
            or kv.block_size not in (None, ticket.kv_block_size)  # None: nothing stored yet
        ):
            return inferred
        blocks = kv.match(ticket.kv_chain)
        if not settled:  # a request of the same prompt ahead of it there computes it first
            blocks = max(blocks, kv.match_pending(ticket.kv_chain))
        exact = min(ticket.tokens, blocks * ticket.kv_block_size)
        return exact if kv.state is KvState.WHOLE else max(exact, inferred)

    def fresh_report(self, now: float, stale_after: float) -> LoadReport | None:
        """The last scrape, if it is recent enough to trust; else None (unknown)."""
        report = self.report
        return report if report is not None and now - report.at <= stale_after else None

    def queue_depth(self, report: LoadReport | None = None) -> float:
        """Requests waiting at the instance beyond its running slots: ours, or what a
        fresh scrape (`fresh_report`) says is waiting there, whichever is larger."""
        own = max(0, self.total_inflight - self.slots)
        return own if report is None else max(own, report.waiting)

    @property
    def verdict(self) -> str:
        return {None: "unknown", True: "up", False: "down"}[self.up]

    def __repr__(self) -> str:
        return (
            f"<Instance {self.name} {self.verdict} lane={self.spec.lane} inflight={self.inflight} "
            f"long={self.long_prefilling} failures={self.consecutive_failures} "
            f"ejected_until={self.ejected_until}>"
        )
