"""One attempt at one instance, as values: what it sends and how it ended.

`Call` is the request as every attempt
sends it, fixed once its body is read; `send_headers` is what one attempt sends. An
attempt ends `Committed` (the client has, or is about to get, its answer) or `Failed`
(nothing reached the client: the proxy may try elsewhere, and answers `answer` if it
does not). The proxy decides what to do with each; nothing here waits or raises.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway import errors
from gateway.dispatch import Lane, Limits, Outcome
from gateway.observe.exchange import Exchange
from gateway.proxy import jsoncodec
from gateway.relay.records import Broken, Whole
from gateway.routes import Route
from gateway.upstream.endpoint import Endpoint
from gateway.upstream.response import AttemptFailed


@dataclass(frozen=True)
class Call:
    """A request as each of its attempts sends it."""

    request: web.Request
    route: Route
    body: bytes
    stream: bool  # the client asked for server-sent events
    lane: Lane
    deadline: float  # the clock's time by which its answer must have started
    headers: dict[str, str]  # what every answer to the client carries (request id, tag)
    hide_usage: bool = False  # the gateway asked for the stream's usage chunk: keep it back
    # The `priority` an instance running vLLM's priority scheduler gets, where it is not
    # what the body says already (None: the body as it is, everywhere).
    priority: int | None = None
    # Why a stream its instance breaks would not be continued elsewhere (a refusal of
    # relay/continuation.py, or "off"); None: it would be (migration.py).
    not_migrated: str | None = "off"


@dataclass(frozen=True)
class Committed:
    """The attempt produced the client's answer: a stream already sent, or a whole one."""

    response: web.StreamResponse
    outcome: Outcome  # what it says about the instance
    error: str | None = None  # why it ended badly, for the instance's record
    broken: Broken | None = None  # a stream its instance broke, not yet ended: migrate it


@dataclass(frozen=True)
class Failed:
    """Nothing reached the client: why (a retry reason), for the instance, and our answer.

    `answer` is what the client gets if no retry follows: our own error, or the instance's
    whole answer (a 503 "engine busy" passes on as vLLM wrote it).
    """

    reason: str  # "connect", "timeout", "bad_response", "taken_back", "status_<code>",
    # or "unsendable" / "shutting_down" (the gateway's own, `final`)
    outcome: Outcome
    answer: errors.GatewayError | Whole
    final: bool = False  # no other instance would do better: answered, not retried

    @property
    def note(self) -> str:
        """How the instance's recent errors name it: "connect", or "status 503"."""
        return self.reason.replace("_", " ") if self.reason.startswith("status_") else self.reason


def failed_to_send(failed: AttemptFailed, retry_after: float) -> Failed:
    """An attempt that got no response head: the error the client gets if none follows."""
    error: errors.GatewayError
    if failed.kind == "unsendable":  # a configured header or URL the gateway cannot write
        error = errors.UpstreamError(
            f"the gateway could not send the request to the vLLM instance ({failed.detail})"
        )
        return Failed(failed.kind, Outcome.NEUTRAL, error, final=True)
    if failed.kind == "shutting_down":  # its connections closed under the request
        error = errors.ShuttingDown("the gateway is shutting down", retry_after=retry_after)
        return Failed(failed.kind, Outcome.NEUTRAL, error, final=True)
    if failed.kind == "timeout":
        error = errors.UpstreamTimeout(
            f"the vLLM instance did not answer in time ({failed.detail})"
        )
    elif failed.kind == "bad_response":
        error = errors.UpstreamError(
            f"the vLLM instance's response header was too large or malformed ({failed.detail})"
        )
    else:  # nothing reached a GPU: the client may retry as soon as an instance is back
        error = errors.NoInstanceAvailable(
            f"could not reach a vLLM instance ({failed.detail})", retry_after=retry_after
        )
    return Failed(failed.reported, Outcome.FAILURE, error)


def taken_back(instance: str, limits: Limits) -> Failed:
    """The place was taken back before a token came (the instance runs fewer than its
    configured slots): no fault of the instance; elsewhere, or refused with Retry-After."""
    error = errors.NoInstanceAvailable(
        f"the vLLM instance {instance} runs fewer requests at once than configured and "
        "could not start this one in time; retry after the delay in Retry-After",
        retry_after=limits.queue_retry_after,
    )
    return Failed("taken_back", Outcome.NEUTRAL, error)


def vllm_priority(call: Call, payload: dict[str, Any], key_priority: int) -> Call:
    """`call` with the `priority` its key gives it on vLLM's priority scheduler: the key's,
    or the client's own if that is later (a client may yield, never jump the queue). A
    value that is not an integer is left as sent: vLLM answers it (400)."""
    sent = payload.get("priority", 0)
    if type(sent) is not int:
        return call
    priority = max(sent, key_priority)
    return call if priority == sent else dataclasses.replace(call, priority=priority)


def send_body(call: Call, endpoint: Endpoint) -> bytes:
    """The body as `endpoint` gets it: with the key's `priority` where it runs vLLM's
    priority scheduler (elsewhere it means nothing: vLLM v1 ignores it, v0 refused it)."""
    if call.priority is None or not endpoint.priority_scheduling:
        return call.body
    return jsoncodec.with_field(call.body, jsoncodec.loads(call.body), "priority", call.priority)


def send_headers(
    call: Call, ex: Exchange, endpoint: Endpoint, span_id: str | None
) -> dict[str, str]:
    """The instance's own headers, the client's passed on, and the request's identity.

    `span_id` is the attempt's span when tracing is on: the instance's spans hang under it.
    """
    headers = dict(endpoint.headers)
    headers.update(ex.forward)
    if call.route.form:  # its boundary is in it
        headers["Content-Type"] = call.request.headers["Content-Type"]
    headers["X-Request-Id"] = ex.request_id
    if ex.trace is not None:
        headers["traceparent"] = ex.trace.traceparent(span_id)
        if ex.trace.state:
            headers["tracestate"] = ex.trace.state
    if ex.tag:
        headers["X-Request-Tag"] = ex.tag
    return headers
