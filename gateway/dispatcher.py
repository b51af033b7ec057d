"""The async side of the scheduler: waits for a place, wakes queued requests.

The pure `Scheduler` decides; this class owns the clock, the random generator and the
futures of requests waiting in the gateway queue, and turns decisions into results or
exceptions. Everything here runs on the event loop thread, so the scheduler's counts
change synchronously between awaits and never race.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable

from . import errors
from .dispatch import (
    Assigned,
    Decision,
    Lane,
    LoadReport,
    Outcome,
    Queued,
    Rejected,
    Scheduler,
    Ticket,
)
from .metrics import Metrics

_ids = itertools.count(1)  # ticket ids only need to be unique and increasing


class Dispatcher:
    def __init__(
        self,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.rng = rng or random.Random()
        # time.monotonic, not loop.time(): uvloop's loop clock has millisecond steps,
        # too coarse for time-per-token.
        self.clock = clock or time.monotonic
        self._waiters: dict[int, asyncio.Future[str]] = {}

    def new_ticket(
        self,
        lane: Lane,
        deadline: float,
        exclude: frozenset[str] = frozenset(),
        tokens: int = 0,
        max_tokens: int = 0,
    ) -> Ticket:
        return Ticket(next(_ids), lane, deadline, exclude, tokens, max_tokens)

    async def acquire(self, ticket: Ticket) -> str:
        """Return the instance that takes `ticket`, waiting in the queue if need be.

        Raises the gateway error a client should see when it cannot be placed. If the
        caller is cancelled (its client left), the ticket leaves the queue at once.
        """
        decision = self.scheduler.submit(ticket, self.clock(), self.rng)
        if isinstance(decision, Assigned):
            return decision.instance
        if isinstance(decision, Rejected):
            raise self._rejection(decision)
        return await self._wait(decision)

    async def _wait(self, queued: Queued) -> str:
        ticket = queued.ticket
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = future
        started = self.clock()
        try:
            async with asyncio.timeout(max(0.0, ticket.deadline - started)):
                instance = await future
        except TimeoutError:
            self.scheduler.cancel(ticket.id)
            self.metrics.rejections.labels("deadline").inc()
            raise errors.UpstreamTimeout(
                "the request waited in the gateway queue until its deadline; every instance "
                "was at its limit",
            ) from None
        except asyncio.CancelledError:
            if not self.scheduler.cancel(ticket.id) and future.done() and not future.exception():
                # It was given a place in the same tick the client left: hand it back.
                self.release(ticket.id, Outcome.NEUTRAL)
            raise
        finally:
            self._waiters.pop(ticket.id, None)
        lane = self.metrics.lane_names[ticket.lane]
        self.metrics.queue_wait.labels(lane).observe(self.clock() - started)
        return instance

    def release(self, ticket_id: int, outcome: Outcome, error: str | None = None) -> None:
        self._settle(self.scheduler.release(ticket_id, outcome, self.clock(), self.rng, error))

    def prefill_done(self, ticket_id: int, ttft: float | None = None) -> None:
        self._settle(self.scheduler.prefill_done(ticket_id, self.clock(), self.rng, ttft))

    def observe_tpot(self, name: str, seconds: float) -> None:
        self.scheduler.observe_tpot(name, seconds)

    def probe(self, name: str, ok: bool) -> bool:
        """Record a health probe; return whether the verdict changed."""
        before = self.scheduler.state(name).up
        self._settle(self.scheduler.probe(name, ok, self.clock(), self.rng))
        return self.scheduler.state(name).up != before

    def report_load(self, name: str, running: float, waiting: float, kv: float | None) -> None:
        self.scheduler.report_load(name, LoadReport(running, waiting, kv, self.clock()))

    def close(self) -> None:
        """Shutting down: every queued request gets 503 now."""
        self._settle(self.scheduler.close())

    def _settle(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            future = self._waiters.get(decision.ticket.id)
            if future is None or future.done():
                if isinstance(decision, Assigned):  # nobody waits for it any more
                    self.release(decision.ticket.id, Outcome.NEUTRAL)
                continue
            if isinstance(decision, Assigned):
                future.set_result(decision.instance)
            elif isinstance(decision, Rejected):
                future.set_exception(self._rejection(decision))

    def _rejection(self, decision: Rejected) -> errors.GatewayError:
        self.metrics.rejections.labels(decision.reason).inc()
        after = decision.retry_after
        if decision.reason == "queue_full":
            return errors.Overloaded(
                "every instance is at its queue limit and the gateway queue is full; "
                "retry after the delay in Retry-After",
                retry_after=after,
            )
        if decision.reason == "no_instance":
            return errors.NoInstanceAvailable(
                f"no healthy vLLM instance can take a {decision.ticket.lane.value}-lane request "
                "right now",
                retry_after=after,
            )
        if decision.reason == "shutting_down":
            return errors.ShuttingDown("the gateway is shutting down", retry_after=after)
        return errors.UpstreamTimeout("the request's deadline passed before an instance took it")

    def __repr__(self) -> str:
        return f"<Dispatcher waiting={len(self._waiters)} {self.scheduler!r}>"
