"""An attempt's values: the lease it holds, how a failure is named, what the client is told."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from gateway import errors
from gateway.dispatch import STRATEGIES, InstanceSpec, Lane, Limits, Outcome, Scheduler
from gateway.fleet.dispatcher import Dispatcher
from gateway.observe.metrics import ERROR_KINDS, Metrics
from gateway.proxy.attempt import Failed, failed_to_send
from gateway.upstream.response import AttemptFailed, AttemptKind


def one_instance() -> Dispatcher:
    scheduler = Scheduler([InstanceSpec("a", slots=2)], STRATEGIES["least_busy"](30.0), Limits())
    dispatcher = Dispatcher(
        scheduler, Metrics(CollectorRegistry()), rng=random.Random(0), clock=lambda: 5.0
    )
    dispatcher.probe("a", True)
    return dispatcher


async def test_a_lease_hands_its_place_back_once() -> None:
    """A second release (a finally after an early one) changes nothing and raises nothing."""
    dispatcher = one_instance()
    lease = await dispatcher.lease(dispatcher.new_ticket(Lane.SHORT, 60.0))
    assert (lease.instance, dispatcher.scheduler.state("a").inflight) == ("a", 1)
    assert "held" in repr(lease)
    lease.release(Outcome.FAILURE, "connect")
    lease.release(Outcome.SUCCESS)
    state = dispatcher.scheduler.state("a")
    assert state.inflight == 0
    assert [e for _, e in state.recent_errors] == ["connect"]  # the first release's word stands
    assert "released" in repr(lease)


async def test_a_lease_tells_the_first_token_once_and_remembers_when() -> None:
    """prefill_done reaches the scheduler once; the lease keeps the time for the proxy."""
    dispatcher = one_instance()
    lease = await dispatcher.lease(dispatcher.new_ticket(Lane.SHORT, 60.0))
    lease.prefill_done(7.5, 0.25)
    lease.prefill_done(9.0, 0.5)  # ignored: the first token comes once
    assert lease.first_token_at == 7.5
    lease.release(Outcome.SUCCESS)
    lease.prefill_done(10.0, None)  # after release: nothing to tell
    assert lease.first_token_at == 7.5


@pytest.mark.parametrize(
    ("reason", "note"),
    [("status_503", "status 503"), ("connect", "connect"), ("bad_response", "bad_response")],
)
def test_a_failure_is_noted_for_the_instance_as_before(reason: str, note: str) -> None:
    """Statuses read "status 503" in the instance's recent errors; kinds read as themselves."""
    failed = Failed(reason, Outcome.FAILURE, errors.UpstreamError("x"))
    assert failed.note == note


@pytest.mark.parametrize(
    ("kind", "error", "retry_after"),
    [
        ("timeout", errors.UpstreamTimeout, None),
        ("bad_response", errors.UpstreamError, None),
        ("connect", errors.NoInstanceAvailable, 3.0),
    ],
)
def test_no_response_head_fails_with_the_matching_gateway_error(
    kind: str, error: type[errors.GatewayError], retry_after: float | None
) -> None:
    """Timeouts are 504, unreadable heads 502, unreachable instances 503 with Retry-After."""
    failed = failed_to_send(AttemptFailed(kind, "detail"), retry_after=3.0)
    assert (failed.reason, failed.outcome) == (kind, Outcome.FAILURE)
    assert type(failed.answer) is error
    assert isinstance(failed.answer, errors.GatewayError)
    assert failed.answer.retry_after == retry_after
    assert "detail" in failed.answer.message


def test_a_stale_connection_is_reported_as_connect() -> None:
    """A reused connection the instance had closed is "connect" for retries, metrics and
    recent errors, and the client gets the same 503 with Retry-After."""
    failed = failed_to_send(AttemptFailed("stale", "detail"), retry_after=3.0)
    assert (failed.reason, failed.outcome, failed.final) == ("connect", Outcome.FAILURE, False)
    assert type(failed.answer) is errors.NoInstanceAvailable


@pytest.mark.parametrize(
    ("kind", "error", "status", "retry_after"),
    [
        ("unsendable", errors.UpstreamError, 502, None),
        ("shutting_down", errors.ShuttingDown, 503, 3.0),
    ],
)
def test_the_gateways_own_failures_are_final_and_no_fault_of_the_instance(
    kind: AttemptKind, error: type[errors.GatewayError], status: int, retry_after: float | None
) -> None:
    """A header or URL the gateway cannot write, or its own shutdown, would fail alike on
    every instance: answered at once (`final`), held against no instance (NEUTRAL), and not
    counted as an instance error (the reason is no metric's `kind`)."""
    failed = failed_to_send(AttemptFailed(kind, "detail"), retry_after=3.0)
    assert (failed.reason, failed.outcome, failed.final) == (kind, Outcome.NEUTRAL, True)
    assert type(failed.answer) is error
    assert isinstance(failed.answer, errors.GatewayError)
    assert (failed.answer.status, failed.answer.retry_after) == (status, retry_after)
    assert failed.reason not in ERROR_KINDS
