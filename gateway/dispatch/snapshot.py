"""What the scheduler looked like at one moment, as a frozen value: what metrics, health
logs, readiness and /admin/instances read, instead of the scheduler's live state.

A reader holds a copy: the scheduler moves on (a request is placed, a probe fails) and the
snapshot a scrape is turning into text does not change under it, nor can a reader change
the scheduler through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .kv_index import KvView
from .model import InstanceLane, InstanceState, Lane, LoadReport, Role
from .select import score_all


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    name: str
    verdict: str  # up | down | unknown
    verdict_for: float | None  # seconds since the verdict last changed
    available: bool  # up by its probes, not ejected and not drained
    drained_since: float | None  # wall clock, as the operator's drain gave it
    ejected_for: float | None  # seconds of ejection left
    lane: InstanceLane
    role: Role
    weight: float
    slots: int  # configured
    learned_slots: int | None  # fewer running slots it showed (learned_slots in fleet.py)
    models: frozenset[str] | None  # served, pinned or learned; None while unknown
    pinned_models: frozenset[str] | None
    inflight: int
    # The other gateway processes' there, as the shared view last said.
    peers_inflight: int
    peers_pending_prefill_tokens: int
    long_prefilling: int
    queue_depth: float
    score: float
    load_fresh: bool
    report: LoadReport | None  # the last scrape, however old
    fresh_report: LoadReport | None  # the last scrape if recent enough to trust
    prefix_index_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefill_rate: float | None
    tpot: float | None
    slow: bool
    assigned_total: int
    failures_total: int
    consecutive_failures: int  # requests
    probe_failures_total: int
    consecutive_probe_failures: int
    ejections_total: int
    recent_errors: tuple[tuple[float, str], ...]  # (seconds ago, error), oldest first
    kv: KvView | None = None  # its KV events index (None: it publishes none we hear)


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    strategy: str
    inflight: int
    queues: Mapping[Lane, int]  # requests waiting in the gateway, by lane
    instances: tuple[InstanceSnapshot, ...]
    # Per key: the weighted tokens this process served it, and its requests waiting here.
    key_service: Mapping[str, float] = field(default_factory=dict)
    key_queued: Mapping[str, int] = field(default_factory=dict)
    # Requests waiting here, by the model they name (those naming none left out).
    model_queued: Mapping[str, int] = field(default_factory=dict)

    def up(self) -> tuple[InstanceSnapshot, ...]:
        """The instances that take traffic."""
        return tuple(i for i in self.instances if i.available)


def instances_at(
    states: Sequence[InstanceState], now: float, stale_after: float
) -> tuple[InstanceSnapshot, ...]:
    """Every instance's state at `now`, copied; a scrape older than `stale_after` is stale."""
    scores = score_all(states, now, stale_after)
    instances = []
    for state in states:
        fresh = state.fresh_report(now, stale_after)
        score = scores[state.name]
        until = state.ejected_until
        instances.append(
            InstanceSnapshot(
                name=state.name,
                verdict=state.verdict,
                verdict_for=None if state.verdict_since is None else now - state.verdict_since,
                available=state.available(now),
                drained_since=state.drained_since,
                ejected_for=until - now if until is not None and until > now else None,
                lane=state.spec.lane,
                role=state.spec.role,
                weight=state.spec.weight,
                slots=state.spec.slots,
                learned_slots=state.learned_slots,
                models=state.models,
                pinned_models=state.spec.models,
                inflight=state.inflight,
                peers_inflight=state.peers.inflight,
                peers_pending_prefill_tokens=state.peers.pending_prefill_tokens,
                long_prefilling=state.long_prefilling,
                queue_depth=state.queue_depth(fresh),
                score=score.total,
                load_fresh=score.fresh,
                report=state.report,
                fresh_report=fresh,
                prefix_index_blocks=len(state.cache),
                prefix_query_tokens=state.prefix_query_tokens,
                prefix_hit_tokens=state.prefix_hit_tokens,
                prefill_rate=state.speed.prefill_rate,
                tpot=state.speed.tpot_value,
                slow=state.speed.slow,
                assigned_total=state.assigned_total,
                failures_total=state.failures_total,
                consecutive_failures=state.consecutive_failures,
                probe_failures_total=state.probe_failures_total,
                consecutive_probe_failures=max(0, -state.probe_streak),
                ejections_total=state.ejections_total,
                recent_errors=tuple((now - at, error) for at, error in state.recent_errors),
                kv=None if state.kv is None else state.kv.view(now),
            )
        )
    return tuple(instances)
