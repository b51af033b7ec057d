"""Builders the scheduler's example tests share: a scheduler over named instances, brought
up at once, and short tickets; and looks inside it (which instance holds a ticket, what
waits in its queue, where a ticket is in its life, how many it holds and queues, what a new
request would find ahead of it) that only tests need, so the scheduler does not offer them
(the shell reads its `snapshot`)."""

from __future__ import annotations

import random
from collections.abc import Iterable

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    HealthPolicy,
    Hop,
    InstanceSpec,
    Lane,
    Limits,
    Priority,
    Scheduler,
    Ticket,
)
from gateway.dispatch.ticket_state import TicketState

FAR = 1e9  # a deadline no test reaches


def make(
    *specs: InstanceSpec | str,
    strategy: str = "least_busy",
    limits: Limits | None = None,
    policy: HealthPolicy | None = None,
) -> Scheduler:
    """A scheduler over `specs` (a bare name means a default spec); instances not yet probed."""
    limits = limits or Limits()
    return Scheduler(
        [s if isinstance(s, InstanceSpec) else InstanceSpec(s) for s in specs],
        STRATEGIES[strategy](limits.metrics_stale_after),
        limits,
        policy or HealthPolicy(),
    )


def bring_up(sched: Scheduler, rng: random.Random, now: float = 0.0) -> None:
    """Probe every instance good once: the first probe decides at once."""
    for state in sched.instances.states:
        sched.probe(state.name, True, now, rng)


def tk(
    i: int, lane: Lane = Lane.SHORT, deadline: float = FAR, exclude: Iterable[str] = ()
) -> Ticket:
    return Ticket(i, lane, deadline, frozenset(exclude))


def assigned_to(decision: object) -> str:
    assert isinstance(decision, Assigned), decision
    return decision.instance


def holder(sched: Scheduler, ticket_id: int) -> str | None:
    """The instance the scheduler holds `ticket_id` on (None: it holds no such ticket)."""
    held = sched._holding.get(ticket_id)
    return held.state.name if held else None


def queued_tickets(sched: Scheduler) -> list[Ticket]:
    """The tickets waiting in the scheduler's queue: the retries, then each FIFO in order."""
    return list(sched._queues)


def ticket_state(sched: Scheduler, ticket_id: int) -> TicketState:
    """Where the scheduler keeps `ticket_id` in its life (ticket_state.py); new once it is
    gone, as before it came."""
    return sched._ticket_state(ticket_id)


def inflight_of(sched: Scheduler) -> int:
    """The requests the scheduler holds on instances now."""
    return len(sched._holding)


def queue_length_of(sched: Scheduler, lane: Lane) -> int:
    """The requests waiting in the scheduler's `lane` queue, retries included."""
    return sched._queues.length(lane)


def ahead_of(
    sched: Scheduler,
    lane: Lane,
    model: str | None = None,
    hop: Hop = Hop.WHOLE,
    priority: Priority = Priority.INTERACTIVE,
) -> int:
    """The requests that would start before a new one (Scheduler._ahead)."""
    return sched._ahead(lane, model, hop, priority)


def bounded_of(sched: Scheduler, lane: Lane, priority: Priority = Priority.INTERACTIVE) -> int:
    """What a new request finds against `gateway_queue_size` (Scheduler._bounded)."""
    return sched._bounded(lane, priority)


def predicted_wait_of(
    sched: Scheduler,
    lane: Lane,
    now: float,
    model: str | None = None,
    hop: Hop = Hop.WHOLE,
    priority: Priority = Priority.INTERACTIVE,
) -> float | None:
    """How long a new request would wait to start (Scheduler._predicted_wait)."""
    return sched._predicted_wait(lane, now, model, hop, priority)
